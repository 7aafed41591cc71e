"""The agent's worker processes: a pool of parked warm workers, and the group of one round.

A parked worker has already paid for process start and `import torch` + the trainer (1.5-4 s
here, docs/constraints.md); it waits on stdin for one assignment line. Promotion (a spare
joining, or a restart after a crash) hands assignments to parked workers, so a recovery costs
a process group init and a checkpoint load, not a cold start. The pool refills right after.

Ranks outlive the agent: each runs in a session of its own, without a parent-death signal,
so that an agent restart (an upgrade, a crash of the agent alone) costs no recovery; the next
agent adopts them (lazarus.agent.adopt), and ranks whose agent stays away stop by themselves
(lazarus.trainer.session). Parked workers end with the agent: the stdin they wait on closes.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.agent.adopt import AdoptedRank
from lazarus.agent import frozen, jobfence
from lazarus.agent.zygote import ZYGOTE_RETRY_S, ForkedWorker, Zygote
from lazarus.core import exitcodes, jobcommand, rankfiles
from lazarus.core.contract import WorkerAssignment, exit_note_path, worker_files
from lazarus.core.jobuser import JobUser

log = logging.getLogger(__name__)

PARK_CMD = [sys.executable, "-m", "lazarus.cli", "worker", "--park"]
# A rank's output goes to LOG_DIR/round-<round>/rank-<rank>.log (lazarus.trainer.rankrun), the
# round it was launched in (Group.rank_round). A file past the bound is copied to <file>.1 and
# emptied (what the rank writes meanwhile may be lost: it keeps its file open), so a rank keeps
# at most twice the bound on the node; the directories of the newest KEEP_ROUNDS rounds are
# kept.
RANK_LOG_BYTES = 64 << 20
# A SIGKILLed process is gone within milliseconds unless it sleeps where no signal reaches it
# (state D): past this it is set aside rather than waited for (Workers._kill).
KILL_WAIT_S = 5.0
# What the node status carries of the processes set aside (Workers.set_aside): a few, each
# reason bounded (frozen.where's wchan and file name are bounded too).
UNKILLABLE_SHOWN = 4
UNKILLABLE_WHY_CHARS = 400
KEEP_ROUNDS = 20


def _generation(proc) -> int:
    """A parked worker's rehearsal generation (lazarus.agent.zygote); -1 for a cold one."""
    return getattr(proc, "generation", -1)


def rank_log(log_dir: Path, round_: int, rank: int) -> Path:
    return log_dir / f"round-{round_}" / f"rank-{rank}.log"


def tail(path: Path, nbytes: int) -> str:
    """The last whole lines within `nbytes` of `path` ("" when it cannot be read)."""
    try:
        data, size = rankfiles.read_tail(path, nbytes)
    except OSError:
        return ""
    if size > nbytes:
        data = data.partition(b"\n")[2]  # from the first whole line
    return data.decode("utf-8", errors="replace").strip()


# Why a rank of a round started in a fresh process rather than in its survivor's (in-place
# recovery, docs/inplace.md); said in the node's status and the recovery's event.
ANEW_NEW = "new on this node"                   # no process of this node ran it in the last round
ANEW_FAILED = "failed first"                    # the fault: its process exited or was killed first
ANEW_PEER_LOST = "exited on a lost peer"      # did not stay (in place off, abort past its bound)
ANEW_EXITED = "exited with the round"
ANEW_STOPPED = "stopped with the round"         # running, not a survivor: a frozen or hung rank
ANEW_LET_GO = "survivor let go"                 # the agent let its survivor go (no round for it)
ANEW_SURVIVOR_GONE = "survivor died waiting"
ANEW_NOT_REACHED = "survivor took no assignment"


@dataclass(slots=True)
class Group:
    """The workers of one round on this node."""
    round: int
    procs: dict[int, subprocess.Popen | AdoptedRank]  # local rank -> process
    ranks: dict[int, int]                       # local rank -> global rank
    exit_codes: dict[int, int] = field(default_factory=dict)
    fault_at: float = 0.0
    first_failure: int | None = None            # local rank that failed first: the culprit
    # local ranks that lost a peer, not themselves, and wait for the next round in their
    # process (lazarus.trainer.inplace)
    survivors: set[int] = field(default_factory=set)
    kept: set[int] = field(default_factory=set)  # local ranks in a survivor's process
    # local rank -> why it started in a fresh process, not kept from the round before (ANEW_*):
    # what a recovery's event says of the ranks that did not go on in place
    anew: dict[int, str] = field(default_factory=dict)
    # local ranks that run a program of the job's own (jobcommand.PROGRAM): no Lazarus code
    # in their process says whether their exit was a lost peer; their output does
    programs: set[int] = field(default_factory=set)
    # The round the ranks were launched in: `round` until a replica round carries them on
    # (lazarus.agent.rounds.carry_on), which relabels `round` alone. Their assignments, and so
    # their messages, their logs and their replica's world, keep this one.
    rank_round: int | None = None

    def __post_init__(self) -> None:
        if self.rank_round is None:
            self.rank_round = self.round

    @property
    def alive(self) -> bool:
        return len(self.exit_codes) < len(self.procs)

    @property
    def failed(self) -> bool:
        return any(code != 0 for code in self.exit_codes.values())

    @property
    def succeeded(self) -> bool:
        return not self.alive and not self.failed

    def failed_rank(self) -> int | None:
        return None if self.first_failure is None else self.ranks[self.first_failure]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]


class Workers:
    """`nproc` is the number of ranks this node runs; `park` keeps that many warm workers.
    `notes_dir`: where ranks leave their exit codes (lazarus.core.contract.exit_note_path).
    `user`: whom the workers (and the zygote) run as, when not the agent's user."""

    def __init__(self, *, nproc: int, env: dict[str, str], log_dir: Path, notes_dir: Path,
                 park: bool = True, log_bytes: int = RANK_LOG_BYTES, user: JobUser | None = None,
                 fence_jobs: bool = True):
        self.log_bytes = log_bytes
        self.user = user
        self.nproc = nproc
        self.env = env
        self.log_dir = log_dir
        self.notes_dir = notes_dir
        self.park = park
        self.parked: list[subprocess.Popen | ForkedWorker] = []
        # Parked workers are forked from a zygote that imported everything once
        # (lazarus.trainer.zygote); while it starts, or after it failed, cold ones.
        self.zygote: Zygote | None = None
        self._zygote_failed_at = -ZYGOTE_RETRY_S
        self._zygote_unfit = False
        self._zygote_lock = threading.Lock()  # the preflight thread asks for it too
        self.group: Group | None = None
        # local rank -> the process of a survivor of the stopped round, until the next
        # round's launch takes it or lets it go
        self.kept: dict[int, subprocess.Popen | AdoptedRank] = {}
        # local rank -> why its process of the stopped round did not survive it (ANEW_*),
        # until the next launch reads it
        self.ended: dict[int, str] = {}
        self._rehearsed_round = -1  # the last round `rehearse` asked the zygote about
        self.job: str | None = None  # the job whose ranks this node runs or ran last
        # pid -> (process, why, global rank or None): killed, but in a wait no signal ends
        # (see _kill); the node status says so, and the daemon cordons the node for it
        self.unkillable: dict[int, tuple] = {}
        self.fence_jobs = fence_jobs  # see new_job
        log_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(self) -> subprocess.Popen:
        """A cold worker: its own interpreter, imports and all."""
        out = rankfiles.open_log(self._worker_log())
        try:
            # A session of its own: a signal to the agent's process group (a terminal's
            # Ctrl-C, a supervisor's stop) does not reach the ranks.
            return subprocess.Popen(PARK_CMD, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True,
                                    **(self.user.popen_kwargs() if self.user else {}))
        finally:
            os.close(out)

    def _worker_log(self) -> Path:
        return self.log_dir / f"worker-{time.time_ns()}.log"

    def ready_zygote(self, wait_s: float) -> Zygote | None:
        """The zygote once it has imported everything, waiting up to `wait_s` for it (from
        another thread than the agent's loop: preflight's); None without one."""
        deadline = time.monotonic() + wait_s
        while self.park:
            z = self._live_zygote()
            if z is None or z.dead:
                return None
            z.pump()
            if z.ready:
                return z
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return None

    def _live_zygote(self) -> Zygote | None:
        """The zygote, started if there is none; None while a failed one waits out its
        ZYGOTE_RETRY_S (cold workers meanwhile)."""
        with self._zygote_lock:
            return self._zygote_now()

    def _zygote_now(self) -> Zygote | None:
        z = self.zygote
        if z is not None and (z.dead or z.stuck()):
            if z.dead and _exit_code(z.proc) == exitcodes.ZYGOTE_UNFIT:
                # a retry would import the same way: no use paying for it every minute
                log.warning("worker zygote (pid %d): this node's imports initialise CUDA, so "
                            "forks could not use the GPU; every worker starts cold (%s)",
                            z.proc.pid, self.log_dir / "zygote.log")
                self._zygote_unfit = True
            else:
                log.warning("worker zygote (pid %d) %s: cold workers for %.0f s", z.proc.pid,
                            "gone" if z.dead else "stuck", ZYGOTE_RETRY_S)
            z.kill()
            self.zygote = z = None
            self._zygote_failed_at = time.monotonic()
        if (z is None and not self._zygote_unfit
                and time.monotonic() - self._zygote_failed_at >= ZYGOTE_RETRY_S):
            self.zygote = z = Zygote(env=self.env, log_path=self.log_dir / "zygote.log",
                                     notes_dir=self.notes_dir, user=self.user)
            self._rehearsed_round = -1  # a new zygote has rehearsed nothing
        return z

    def refill(self) -> None:
        """Top the parked pool up to nproc without waiting: forks of the zygote when it is
        up (what they ask for arrives on a later call), cold workers when it failed. Once
        nproc forks made after the zygote's last rehearsal are parked, the workers from
        before it are let go: they would start without its caches."""
        self.parked = [p for p in self.parked if p.poll() is None]
        if not self.park:
            return
        z = self._live_zygote()
        if z is None:
            while len(self.parked) < self.nproc:
                self.parked.append(self._spawn())
            return
        self.parked += z.take()
        if not z.ready:
            return
        fresh = [p for p in self.parked if _generation(p) == z.generation]
        for _ in range(self.nproc - len(fresh) - z.in_flight):
            z.spawn(self._worker_log())
        if len(fresh) >= self.nproc and len(self.parked) > len(fresh):
            old = [p for p in self.parked if _generation(p) != z.generation]
            self.parked = fresh
            for proc in old:
                proc.kill()
            # cold ones are this process's children: reaped here (SIGKILLed, at once)
            self._kill([p for p in old if not isinstance(p, ForkedWorker)])

    def rehearse(self, round_: int, command: list[str], train: dict, world_size: int) -> None:
        """Have the zygote rehearse the step of round `round_`'s job, so that the workers it
        forks next start it with DTensor's caches filled (lazarus.trainer.rehearsal): the
        built-in trainer's only, whose model the round names. Every node asks, spares too:
        a spare's worker is the new rank of a node loss. Once per round; the zygote itself
        is asked once per job shape, and `refill` then renews the pool. `world_size`: the
        ranks of a rank's own world (its replica's in a job of replica groups)."""
        z = self.zygote
        if (round_ == self._rehearsed_round or z is None or z.dead or not z.ready
                or not jobcommand.is_builtin(command)):
            return
        self._rehearsed_round = round_
        # Skipped windows change no shape, and a long list of them would not fit one message.
        data = {k: v for k, v in (train.get("data") or {}).items() if k != "skip_windows"}
        z.rehearse({**train, "data": data}, world_size)

    def launch(self, round_: int, assignments: dict[int, WorkerAssignment], *,
               resume: Callable[[int, WorkerAssignment], bool] | None = None) -> Group:
        """Start the round's workers: `assignments` maps local rank -> its assignment. A
        survivor kept for the same local rank takes its assignment through `resume(pid,
        assignment)` (the worker channel) when that reaches it; parked workers take the
        rest, and survivors not taken are let go."""
        assert self.group is None or not self.group.alive, "stop the old round first"
        procs, ranks, kept, anew = {}, {}, set(), {}
        ended, self.ended = self.ended, {}
        if self.group is not None:  # every rank of it exited: never stopped
            ended = {lr: ended_why(self.group, lr) for lr in self.group.procs}
        if self.zygote is not None and not self.zygote.dead:
            self.parked += self.zygote.take()
        self.parked = [p for p in self.parked if p.poll() is None]
        # the newest forks first: those made after the zygote's last rehearsal start warm
        self.parked.sort(key=_generation, reverse=True)
        for local_rank, assignment in sorted(assignments.items()):
            survivor = self.kept.pop(local_rank, None)
            if (survivor is not None and resume is not None and survivor.poll() is None
                    and resume(survivor.pid, assignment)):
                procs[local_rank] = survivor
                ranks[local_rank] = assignment.rank
                kept.add(local_rank)
                continue
            anew[local_rank] = ended.get(local_rank, ANEW_NEW)
            if survivor is not None:
                # An operator reading why a recovery was not in place: the survivor died
                # while it waited (a second fault), or the channel could not reach it.
                gone = survivor.poll() is not None
                anew[local_rank] = ANEW_SURVIVOR_GONE if gone else ANEW_NOT_REACHED
                log.warning("round %d rank %d: the survivor kept for it (pid %d) %s; starting "
                            "it anew", round_, assignment.rank, survivor.pid,
                            "is gone" if gone else "took no assignment")
                self.kept[local_rank] = survivor  # let go below, with the others not taken
            proc = self.parked.pop(0) if self.parked else self._spawn()
            line = (assignment.to_json() + "\n").encode()
            try:
                proc.stdin.write(line)
                proc.stdin.close()
            except OSError:
                # A parked worker that died while waiting: use a fresh one.
                proc = self._spawn()
                proc.stdin.write(line)
                proc.stdin.close()
            procs[local_rank] = proc
            ranks[local_rank] = assignment.rank
        if assignments:
            a = next(iter(assignments.values()))
            self.rehearse(round_, a.command, a.train, a.replica_place[2])
        self.drop_kept()
        programs = {lr for lr, a in assignments.items()
                     if jobcommand.how_run(a.command) == jobcommand.PROGRAM}
        self.group = Group(round=round_, procs=procs, ranks=ranks, kept=kept, anew=anew,
                           programs=programs)
        return self.group

    def carry_on(self, round_: int) -> Group:
        """The running group goes on as round `round_`'s, untouched (a replica round that
        leaves its replica be: docs/replicas.md). No rank of it started anew, nor in place,
        in that round."""
        g = self.group
        assert g is not None and g.alive, "only running ranks are carried on"
        g.round = round_
        g.anew, g.kept = {}, set()
        return g

    def drop_kept(self) -> None:
        """Let the survivors go, kept or still in the current group: no round of this node
        takes them."""
        kept, self.kept = self.kept, {}
        self.ended.update(dict.fromkeys(kept, ANEW_LET_GO))
        g = self.group
        waiting = [g.procs[lr] for lr in g.survivors] if g is not None else []
        self._kill(list(kept.values()) + waiting,
                   ranks={g.procs[lr].pid: g.ranks[lr] for lr in g.survivors} if g else None)

    def bound_logs(self) -> None:
        """Keep the current round's rank logs within the bound (see RANK_LOG_BYTES)."""
        g = self.group
        if g is None:
            return
        for rank in g.ranks.values():
            path = rank_log(self.log_dir, g.rank_round, rank)
            try:
                if rankfiles.size(path) <= self.log_bytes:
                    continue
                # the rank opens its log: never a symlink's target truncated, nor written
                rankfiles.rotate(path, path.with_name(path.name + ".1"))
            except OSError:
                continue  # not there yet, or the disk is full: the next pass tries again

    def prune_logs(self, current: int) -> None:
        """Remove the log directories of rounds older than the newest KEEP_ROUNDS."""
        old = [p for p in self.log_dir.glob("round-*")
               if p.name[6:].isdigit() and int(p.name[6:]) <= current - KEEP_ROUNDS]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)

    def new_job(self, job_id: str) -> bool:
        """A round of `job_id` is coming. When it is another job's than the last one and the
        ranks run as a user of their own, nothing of the last job stays: its kept survivors,
        the zygote and parked workers forked for it, and every other process of that user
        (lazarus.agent.jobfence). True when the job changed."""
        if job_id == self.job:
            return False
        self.job = job_id
        if self.user is None or not self.fence_jobs:
            return True
        g = self.group
        spare = set(g.pids()) if g is not None and g.alive else set()
        self.drop_kept()
        with self._zygote_lock:
            if self.zygote is not None:
                self.zygote.kill()
                self.zygote = None
            parked, self.parked = self.parked, []
            for proc in parked:
                proc.kill()
            self._kill([p for p in parked if not isinstance(p, ForkedWorker)])
            killed = jobfence.sweep(self.user.uid, spare=spare)
        if killed:
            log.warning("job %s: ended %d process(es) of user %s left from before it (pids %s)",
                        job_id[:64], len(killed), self.user.name,
                        " ".join(map(str, killed[:20])))
        return True

    def adopt(self, round_: int, procs: dict[int, AdoptedRank], ranks: dict[int, int], *,
              rank_round: int | None = None) -> Group:
        """Take over the ranks a previous agent of this node left running (launched in
        `rank_round`, the same as `round_` unless a replica round carried them on)."""
        assert self.group is None, "adopt before launching anything"
        self.group = Group(round=round_, procs=dict(procs), ranks=dict(ranks),
                           rank_round=rank_round)
        return self.group

    def poll(self) -> bool:
        """Collect exits of the current group; True when something changed."""
        if self.unkillable:
            self.reap_unkillable()
        g = self.group
        if g is None:
            return False
        changed = False
        for local_rank, proc in g.procs.items():
            if local_rank not in g.exit_codes and (code := proc.poll()) is not None:
                output = tail(rank_log(self.log_dir, g.rank_round, g.ranks[local_rank]), 8192)
                if exitcodes.watchdog_abort(code, output):
                    log.warning("round %d rank %d (pid %d): NCCL's watchdog aborted it; "
                                "counted as a lost peer", g.round, g.ranks[local_rank], proc.pid)
                    code = exitcodes.PEER_LOST
                elif local_rank in g.programs and exitcodes.peer_lost_in_output(code, output):
                    log.warning("round %d rank %d (pid %d) exited with %d on a lost peer's "
                                "error; counted as a lost peer", g.round, g.ranks[local_rank],
                                proc.pid, code)
                    code = exitcodes.PEER_LOST
                g.exit_codes[local_rank] = code
                changed = True
                exit_note_path(self.notes_dir, proc.pid).unlink(missing_ok=True)
                self._forget(proc.pid)
                if code != 0 and g.first_failure is None:
                    g.fault_at = time.time()
                    g.first_failure = local_rank
                    log.warning("round %d rank %d (pid %d) exited with %d", g.round,
                                g.ranks[local_rank], proc.pid, code)
        return changed

    def stop(self, keep: Collection[int] = ()) -> None:
        """End the current group at once: its round is over and its state is in checkpoints.
        The survivors among `keep` (local ranks) are kept for the next round's launch; the
        others are killed."""
        g = self.group
        if g is None:
            return
        for local_rank in keep:
            proc = g.procs.get(local_rank)
            if local_rank in g.survivors and proc is not None and proc.poll() is None:
                self.kept[local_rank] = proc
        self.ended = {lr: ended_why(g, lr) for lr in g.procs if lr not in self.kept}
        self._kill([p for lr, p in g.procs.items() if lr not in self.kept],
                   ranks={p.pid: g.ranks[lr] for lr, p in g.procs.items()})
        self.group = None

    def _kill(self, procs: list, ranks: dict[int, int] | None = None) -> None:
        """SIGKILL `procs` and wait for them, KILL_WAIT_S at most; `ranks`: pid -> the global
        rank it ran, said of one set aside."""
        for proc in procs:
            _kill_group(proc.pid)
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + KILL_WAIT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        for proc in procs:
            if proc.poll() is None:
                # In an uninterruptible wait SIGKILL cannot end (an NFS hard mount, a FUSE
                # server that never answers): waiting for it would stop this agent's loop.
                why = (frozen.unkillable(proc.pid)
                       or f"still there {KILL_WAIT_S:.0f} s after its SIGKILL")
                log.error("pid %d %s: set aside, this agent goes on; it is reaped if it ever "
                          "ends", proc.pid, why)
                self.unkillable[proc.pid] = (proc, why, (ranks or {}).get(proc.pid))
            else:
                self._forget(proc.pid)

    def reap_unkillable(self) -> None:
        """Reap what `_kill` set aside, once it ended."""
        for pid, (proc, *_) in list(self.unkillable.items()):
            if proc.poll() is not None:
                del self.unkillable[pid]
                self._forget(pid)
                log.info("pid %d set aside earlier ended at last", pid)

    def set_aside(self) -> list[dict]:
        """The processes `_kill` could not end, as the node status says them: {"pid", "rank"
        (None: a worker of no round, parked or let go), "why"}, the first UNKILLABLE_SHOWN by
        pid. One is enough for the daemon to cordon the node."""
        return [{"pid": pid, "rank": rank, "why": why[:UNKILLABLE_WHY_CHARS]}
                for pid, (_proc, why, rank) in sorted(self.unkillable.items())
                [:UNKILLABLE_SHOWN]]

    def _forget(self, pid: int) -> None:
        # A weeks-long run starts thousands of workers: their files must not pile up.
        for path in worker_files(self.notes_dir, pid):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # what cannot go now is a few bytes

    def shutdown(self, *, leave_ranks: bool = False) -> None:
        """Stop every worker; with `leave_ranks`, the parked ones only (the round's ranks
        wait for the next agent)."""
        if not leave_ranks:
            self.stop()
        self.drop_kept()
        if self.zygote is not None:
            self.parked += self.zygote.take()
        for proc in self.parked:
            proc.kill()
        for proc in self.parked:
            proc.wait()
        self.parked = []
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


def _kill_group(pid: int) -> None:
    """SIGKILL what worker `pid` started in its process group: every worker leads a session
    of its own (parked cold or forked by the zygote), and what it starts stays in it -- a
    shell wrapper's python, a script's data loader processes -- even once the worker itself
    died (a wrapper killed by a fault leaves its python training). Linux gives no new process
    the pid of a group that still has members; once it has none, the pid could only name a
    new process that made a group of its own with it in the moments since -- a risk taken,
    against ranks left training outside any round."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def ended_why(g: Group, local_rank: int) -> str:
    """Why the process of `local_rank` in `g` does not go on to the next round (ANEW_*)."""
    if local_rank in g.survivors:
        return ANEW_LET_GO
    code = g.exit_codes.get(local_rank)
    if local_rank == g.first_failure and code != exitcodes.PEER_LOST:
        return ANEW_FAILED
    if code is None:
        code = g.procs[local_rank].poll()
    if code is None:
        return ANEW_STOPPED
    return ANEW_PEER_LOST if code == exitcodes.PEER_LOST else ANEW_EXITED


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The code of a process that has closed its end, given a moment to finish exiting."""
    try:
        return proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return None
