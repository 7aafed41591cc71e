"""A fleet of simulated nodes in one process: the control plane's load at cluster scale.

N simulated agents speak the real agent protocol to a real etcd (and through it to the real
daemon): each registers its node under a lease of its own, follows the run's rounds, runs
ranks that step, and writes its node status by the agent's own rule. What is simulated is
only what an agent drives -- processes, sockets, GPUs -- never what it decides:

- `SimAgent` IS a `lazarus.agent.service.Agent`, built by the agent's own constructor with
  the fleet's ports (`FleetPorts`, lazarus.agent.ports) and run by its own `pass_once`:
  registration, the node status record, the write rule (a change of state at once, else once
  a jittered status period while the step moves), when to read the assignment (on news, else
  every REREAD_S), following rounds (stop a finished round, launch the current one), the
  worker channel's step reports and checkpoint commits are the agent's own methods. Only
  what it drives is the fleet's: no TCPStore, unix socket, GPU monitor or lock file (too
  heavy for thousands in one process), and its etcd reads and lease are served by the fleet.
- Its ranks are `SimRank`s handed out by the agent's own `Workers` (one seam: `_spawn`); they
  take the real assignment line, step on a shared clock once their round's whole world has
  joined, and exit with the code real ranks use for a crash. They tell their agent what real
  ranks do, so that a node status carries what a real one does: each step's report (with its
  work time and data window: the throughput summary), a tier-0 snapshot each step (the
  node's holdings, its own ranks' and its ring predecessor's, steps advancing), their
  checkpoint phases (progress records in and out of each save: the long phase), and when a
  peer goes, that they survive it and wait in their process (lazarus.trainer.inplace): the
  next round takes them in place, over the channel, and the status says so.
- One etcd client serves the whole fleet (one client per process, lazarus.core.etcd), and
  what an agent reads when it decides to read (run/status, the round record, the checkpoint
  request) is read once for all of them by a follower that watches run/ and commands/ as
  every agent does. Each agent still counts its reads (`Agent.assignments.reads`): the read load a fleet
  of real agents puts on etcd. Node leases are kept alive by a child process
  (lazarus.sim.leasekeeper), in batches on keep-alive streams.

Faults are injected from outside (`crash`, `lose_node`) and timed: the fault, when the
control plane could see it (the failed status written; the node's lease gone), and when the
daemon's next round was committed (run/round, watched).
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from lazarus.agent.agentconfig import STATUS_PERIOD_S, AgentConfig
from lazarus.agent.health import NodeHealth
from lazarus.agent.service import RECONCILE_S, Agent
from lazarus.agent.tier0_agent import DEFAULT_MEMORY_MB, ring_peer
from lazarus.agent.workers import Group, Workers
from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core.contract import WorkerAssignment
from lazarus.core.embedded_etcd import die_with_parent
from lazarus.core.errors import UserError
from lazarus.core.records import (
    RENDEZVOUS,
    ROLE_ACTIVE,
    ROLE_SPARE,
    RUNNING,
    W_FAILED,
    Keys,
    RecordError,
    RoundRecord,
    RunStatus,
)

log = logging.getLogger("lazarus.fleet")

# Simulated pids: above any real pid_max, so that nobody mistakes one for a process.
_FIRST_PID = 1 << 23
CRASH_EXIT = 1  # what a Python rank dying of an exception exits with


# -- ranks ---------------------------------------------------------------------------------------
class World:
    """The ranks of one round across the fleet. They step together (synchronous training) once
    every rank has joined -- a process group needs them all -- plus `startup_s` (group init,
    checkpoint load); once one is lost the others stop after `peer_lost_s`, as collectives
    notice a dead peer, and survive it."""

    def __init__(self, round_: int, size: int, *, startup_s: float, first_step: int):
        self.round, self.size = round_, size
        self.startup_s = startup_s
        self.first_step = first_step     # the step after the restored checkpoint's
        self.joined = 0
        self.start: float | None = None  # when step `first_step` began
        self.broken_at: float | None = None

    def join(self, now: float) -> None:
        self.joined += 1
        if self.joined == self.size:
            self.start = now + self.startup_s

    def step(self, now: float, step_time_s: float) -> int:
        """The last step every rank has finished by `now`; first_step - 1 before the first."""
        if self.start is None:
            return self.first_step - 1
        until = now if self.broken_at is None else min(now, self.broken_at)
        return self.first_step - 1 + max(0, int((until - self.start) / step_time_s))

    def ended(self, step: int, step_time_s: float) -> float:
        """When `step` ended (a wall time), once the world has started."""
        assert self.start is not None
        return self.start + (step - self.first_step + 1) * step_time_s

    def break_(self, now: float) -> None:
        if self.broken_at is None:
            self.broken_at = now


class SimRank:
    """A rank as the agent's Workers handles one (pid, stdin for the assignment line, poll,
    signals), stepping on the fleet's clock instead of a GPU's."""

    def __init__(self, fleet: Fleet, pid: int):
        self.fleet, self.pid = fleet, pid
        self.returncode: int | None = None
        self.assignment: WorkerAssignment | None = None
        self.started = time.time()
        self.survived = False  # lost a peer; waits in its process for the next round

    def resume(self, a: WorkerAssignment) -> None:
        """A survivor takes its rank of the next round in the same process."""
        self.assignment, self.survived = a, False
        self.fleet.join(a)

    @property
    def stdin(self) -> SimRank:
        return self

    def write(self, line: bytes) -> None:
        """The assignment line a parked worker reads on stdin."""
        self.assignment = WorkerAssignment.from_json(line.decode())
        self.fleet.join(self.assignment)

    def close(self) -> None:
        pass

    def poll(self) -> int | None:
        return self.returncode

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code

    def send_signal(self, sig: int) -> None:
        self.exit(-sig)

    def kill(self) -> None:
        self.exit(-signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class SimWorkers(Workers):
    """The agent's own worker bookkeeping (launch, poll, stop), with ranks that are SimRanks."""

    def __init__(self, fleet: Fleet, *, nproc: int, scratch: Path):
        super().__init__(nproc=nproc, env={}, log_dir=scratch, notes_dir=scratch, park=False)
        self.fleet = fleet
        self.live: dict[int, SimRank] = {}  # pid -> rank: whom the channel reaches

    def _spawn(self) -> SimRank:
        self.live = {pid: r for pid, r in self.live.items() if r.returncode is None}
        rank = SimRank(self.fleet, self.fleet.next_pid())
        self.live[rank.pid] = rank
        return rank


# -- leases ----------------------------------------------------------------------------------------
class SimSession:
    """A node's lease, kept alive by the fleet's `Leases` (an `E.Session`'s face, as the agent
    uses it: `lease`, `lost`, `mark_lost`, `close`)."""

    def __init__(self, leases: Leases, lease: int):
        self._leases = leases
        self.lease = lease
        self.resumed = False
        self.lost = threading.Event()

    def mark_lost(self) -> None:
        if not self.lost.is_set():
            self.lost.set()
            self._leases.forget(self)

    def close(self, *, revoke: bool = True) -> None:
        self._leases.forget(self)
        if revoke and not self.lost.is_set():
            try:
                self._leases.etcd.revoke(self.lease)
            except E.EtcdUnavailable:
                pass


class Leases:
    """Every node's lease, granted here and kept alive every TTL/3 by a child process
    (lazarus.sim.leasekeeper) that does nothing else: a keep-alive starved by the simulated
    agents' work would be a node loss that never happened. A lease etcd no longer knows is
    lost, as in `E.Session` (its node registers again under a new one). `late`: how far
    behind its schedule the keeper's worst renewal round started (0: never more than a tenth
    of the TTL)."""

    def __init__(self, etcd: E.Etcd, ttl_s: int):
        self.etcd, self.ttl_s = etcd, ttl_s
        self.late = 0.0
        self._live: dict[int, SimSession] = {}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lazarus.sim.leasekeeper", self.etcd.endpoint,
             str(self.ttl_s), *self.etcd.auth.args()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            bufsize=1, preexec_fn=die_with_parent)
        self._reader = threading.Thread(target=self._read, daemon=True, name="fleet-leases")
        self._reader.start()

    def _tell(self, line: str) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.write(line + "\n")
                except (BrokenPipeError, ValueError):
                    pass

    def new(self) -> SimSession:
        session = SimSession(self, self.etcd.grant(self.ttl_s))
        with self._lock:
            self._live[session.lease] = session
        self._tell(f"+{session.lease:x}")
        return session

    def forget(self, session: SimSession) -> None:
        """Stop refreshing: the lease runs out one TTL later (a node that died)."""
        with self._lock:
            known = self._live.pop(session.lease, None) is not None
        if known:
            self._tell(f"-{session.lease:x}")

    def _read(self) -> None:
        for line in self._proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "late":
                self.late = max(self.late, float(rest))
                log.warning("lease keep-alives ran %.2f s late: the machine is too busy for "
                            "this fleet, and nodes may be lost that did not fail", float(rest))
            elif word == "lost":
                for lease in rest.split():
                    with self._lock:
                        session = self._live.get(int(lease, 16))
                    if session is not None:
                        log.warning("lease %s of simulated node expired", lease)
                        session.mark_lost()

    def stop(self) -> None:
        if self._proc is not None:
            with self._lock:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)


# -- what every agent reads ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Assignment:
    """run/status, the record of its round and the checkpoint request, as one agent's
    reconcile reads them (lazarus.agent.service.Agent._read_assignment)."""
    status: RunStatus | None
    round: RoundRecord | None
    checkpoint_request: E.KV | None
    read_at: float


class RunFollower:
    """Reads the assignment for the whole fleet when run/ or commands/ change (watched, as
    every agent watches them), and at least every RECONCILE_S; records when the daemon
    committed each round (run/round) and when each node's registration vanished (its lease
    expired), which is how faults are timed."""

    def __init__(self, etcd: E.Etcd, keys: Keys):
        self.etcd, self.keys = etcd, keys
        self.current = Assignment(None, None, None, 0.0)
        self.wake = threading.Event()
        self.changed = threading.Condition()
        self.round_commits: list[tuple[float, int]] = []     # (time, round)
        self.node_gone: dict[str, list[float]] = {}          # node -> times its key vanished
        self._stop = threading.Event()
        self._watches: list[E.Watch] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="fleet-follower")

    def start(self) -> None:
        rev = E.retry(lambda: self.etcd.snapshot([self.keys.status]), deadline_s=30).revision
        resync = lambda: self.etcd.revision(self.keys.root) + 1
        self._watches = [
            self.etcd.watch_prefix(self.keys.root + "run/", start_revision=rev + 1,
                                   on_events=self._on_run, on_resync=resync),
            self.etcd.watch_prefix(self.keys.root + "commands/", start_revision=rev + 1,
                                   on_events=lambda _e: self.wake.set(), on_resync=resync),
            self.etcd.watch_prefix(self.keys.nodes, start_revision=rev + 1,
                                   on_events=self._on_nodes, on_resync=resync)]
        self._thread.start()

    def _on_run(self, events: list[E.Event]) -> None:
        now = time.time()
        for ev in events:
            if ev.kind == "PUT" and ev.kv.key == self.keys.round:
                try:
                    self.round_commits.append((now, int(ev.kv.value)))
                except ValueError:
                    pass
        self.wake.set()

    def _on_nodes(self, events: list[E.Event]) -> None:
        now = time.time()
        for ev in events:
            if ev.kind == "DELETE":
                self.node_gone.setdefault(ev.kv.key[len(self.keys.nodes):], []).append(now)

    def read(self) -> Assignment:
        snap = self.etcd.snapshot([self.keys.status, self.keys.round,
                                   self.keys.checkpoint_request])
        status = rec = None
        kv = snap.kvs.get(self.keys.status)
        if kv is not None:
            try:
                status = RunStatus.from_json(kv.value, self.keys.status)
            except RecordError:
                status = None
        if status is not None and status.round:
            kv = self.etcd.get(self.keys.round_key(status.round))
            if kv is not None:
                try:
                    rec = RoundRecord.from_json(kv.value, kv.key)
                except RecordError:
                    rec = None
        return Assignment(status, rec, snap.kvs.get(self.keys.checkpoint_request), time.time())

    def _run(self) -> None:
        outage = E.OutageLog(self.etcd, log, "the simulated ranks keep training")
        while not self._stop.is_set():
            self.wake.wait(RECONCILE_S)
            self.wake.clear()
            try:
                got = self.read()
                outage.ok()
            except E.EtcdUnavailable as e:
                outage.failed(e)
                self._stop.wait(0.5)
                continue
            cur = self.current
            if (got.status, got.round, got.checkpoint_request) == (
                    cur.status, cur.round, cur.checkpoint_request):
                continue  # no news: the agents' own REREAD_S reads are theirs to make
            with self.changed:
                self.current = got
                self.changed.notify_all()

    def wait(self, pred, timeout_s: float, what: str) -> Assignment:
        end = time.monotonic() + timeout_s
        with self.changed:
            while not pred(self.current):
                left = end - time.monotonic()
                if left <= 0:
                    st = self.current.status
                    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s (run is "
                                       f"{st.state + ' in round ' + str(st.round) if st else 'not started'}"
                                       f"{': ' + st.reason if st else ''})")
                self.changed.wait(min(left, 1.0))
            return self.current

    def stop(self) -> None:
        self._stop.set()
        for w in self._watches:
            w.cancel()
        if self._thread.ident is not None:
            self._thread.join(timeout=5)


# -- tier 0 --------------------------------------------------------------------------------------
class SimTier0:
    """A node's tier 0 as the agent uses it (lazarus.agent.tier0_agent.Tier0), without bytes:
    which steps of which ranks it holds -- its own ranks' snapshots as they report them, and
    copies of its ring predecessor's, which that node's tier 0 hands over as the real one
    sends them -- the `keep` newest per rank, each of `copy_bytes`."""

    def __init__(self, fleet: Fleet, node: str, *, keep: int = 2):
        self.fleet, self.node, self.keep = fleet, node, keep
        self.port = fleet.next_port()  # what the node record advertises; nothing listens
        self.store = SimpleNamespace(incoming=Path("sim://tier0") / node)
        self.copy_bytes = DEFAULT_MEMORY_MB * (1 << 20) // (4 * fleet.config.nproc)
        self._lock = threading.Lock()
        self._steps: dict[int, list[int]] = {}  # rank -> steps held, newest first
        self._job: str | None = None
        self._round: int | None = None
        self._world: int | None = None
        self._peer: str | None = None

    def taken(self, job: str, msg: dict) -> None:
        rank, step = int(msg["rank"]), int(msg["step"])
        self.hold(job, rank, step)
        peer = self.fleet.agents.get(self._peer) if self._peer else None
        if peer is not None and not peer.dead and peer.tier0 is not None:
            peer.tier0.hold(job, rank, step)

    def hold(self, job: str, rank: int, step: int) -> None:
        with self._lock:
            if self._job is not None and job != self._job:
                return  # another job's copy: refused, as the real one refuses it
            steps = self._steps.setdefault(rank, [])
            if step not in steps:
                steps.insert(0, step)
                steps.sort(reverse=True)
                del steps[self.keep:]

    def round_seen(self, rec: RoundRecord) -> None:
        """As the real one: another job's copies, or newer ones than the step the round
        restores, or of another world size, are of no use any more."""
        if rec.round == self._round:
            return
        keep = rec.restore_step if (rec.restore or rec.tier0) else 0
        with self._lock:
            if (self._job is not None and self._job != rec.job_id) or (
                    self._world is not None and self._world != rec.world_size):
                self._steps.clear()
            for steps in self._steps.values():
                steps[:] = [s for s in steps if s <= keep]
            self._round, self._job, self._world = rec.round, rec.job_id, rec.world_size
            self._peer = ring_peer(rec.members, self.node)

    def prepare(self, rec: RoundRecord, ranks: list[int]) -> dict[int, str | None]:
        self.round_seen(rec)
        step = (rec.tier0 or {}).get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return dict.fromkeys(ranks)
        return {rank: f"{self.store.incoming}/r{rank:05d}-s{step:010d}.t0" for rank in ranks}

    def holdings(self, job: str, world_size: int) -> dict:
        if not job:
            return {}
        with self._lock:
            ranks = {str(r): list(steps) for r, steps in sorted(self._steps.items()) if steps}
        return {"job": job, "world": world_size, "ranks": ranks,
                "bytes": self.copy_bytes * sum(len(s) for s in ranks.values()),
                "limit": DEFAULT_MEMORY_MB * (1 << 20)}

    def close(self) -> None:
        pass


# -- the agent -----------------------------------------------------------------------------------
class _SimChannel:
    """The worker channel's face the agent uses: where ranks report, a broadcast, and a
    message to one process; what it carries reaches the simulated ranks (SimAgent.heard)."""

    def __init__(self, node: str, agent: SimAgent):
        self.path = f"sim://{node}"
        self._agent = agent

    def broadcast(self, msg: dict) -> None:
        self._agent.heard(msg)

    def send_to(self, pid: int, msg: dict) -> bool:
        return self._agent.heard(msg, pid=pid)

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class _SimStore:
    port: int  # what the node record advertises; no store listens (the ranks never dial it)


class FleetPorts:
    """A simulated node's outside (lazarus.agent.ports.Ports): ranks that are SimRanks, a
    channel to them and a store that nothing dials, no GPU, a tier 0 without bytes, no
    preflight, no record left for a next agent; the lease and the assignment's reads served
    by the fleet."""

    def __init__(self, fleet: Fleet, node: str, agent: SimAgent):
        self.fleet, self.node = fleet, node
        self._agent = agent

    def left(self):
        return None  # no process outlives a simulated agent

    def save_left(self, left) -> None:
        pass

    def session(self, etcd, *, ttl_s, on_lost, resume):
        return self.fleet.leases.new()

    def read_assignment(self, etcd, keys, unreadable, on_request):
        """The agent's read, served from the fleet's (the agent decides when it reads: its
        count is the read load a fleet of real agents puts on etcd)."""
        a = self.fleet.follower.current
        on_request(a.checkpoint_request)
        return a.status, a.round

    def health(self) -> NodeHealth:
        return NodeHealth(gpu_backend="sim", gpus=self.fleet.config.nproc, fault_script=None)

    def workers(self, agent_grace_s: float, script_pg_timeout_s: float) -> SimWorkers:
        return SimWorkers(self.fleet, nproc=self.fleet.config.nproc, scratch=self.fleet.scratch)

    def channel(self, *, on_message, admit) -> _SimChannel:
        return _SimChannel(self.node, self._agent)

    def store(self) -> _SimStore:
        return _SimStore(port=self.fleet.next_port())

    def host_round_store(self, rec, store) -> None:
        """No store of the round's own: the simulated ranks never dial one."""

    def tier0(self, *, lookup, on_kept) -> SimTier0:
        return SimTier0(self.fleet, self.node)

    def preflight(self, *, run, on_done, store):
        return None, None

    def close(self) -> None:
        pass


class SimAgent(Agent):
    """The node agent, built by its own constructor with the fleet's ports (FleetPorts):
    everything it decides and writes is `Agent`'s own code; `tick` is its run loop's pass,
    with what its simulated ranks report fed in first."""

    def __init__(self, fleet: Fleet, *, node: str, role: str):
        cfg = fleet.config
        self.fleet = fleet
        self.dead = False
        self.checkpoint_requested = False
        self._release: int | None = None  # the round whose ranks were told to abort their groups
        super().__init__(fleet.etcd, fleet.keys,
                         AgentConfig(node=node, nproc=cfg.nproc, role=role,
                                     workdir=fleet.scratch, lease_ttl_s=cfg.lease_ttl_s,
                                     status_period_s=cfg.status_period_s,
                                     preflight_every_s=None),
                         FleetPorts(fleet, node, self))
        self.outage = E.OutageLog(self.etcd, log, "the simulated ranks keep training")
        self._seen: Assignment | None = None   # the fleet's read this agent has had news of
        self._fed = (0, 0)          # (round, last step reported to the agent)
        self._saving: tuple[int, float] | None = None  # the save under way: (step, when it ends)

    def heard(self, msg: dict, *, pid: int | None = None) -> bool:
        """What the agent sends its ranks over the channel (to one process: `pid`), as they
        take it; whether it reached one."""
        kind = msg.get("type")
        if kind == "checkpoint_requested":
            self.checkpoint_requested = True
        elif kind == "abort_groups":
            self._release = msg.get("round")  # they abort theirs and survive, at the next pass
        elif kind == "resume" and pid is not None:
            rank = self.workers.live.get(pid)
            if rank is None or rank.returncode is not None:
                return False
            rank.resume(WorkerAssignment.from_dict(msg["assignment"]))
            return True
        return pid is None

    # -- the run loop's pass -----------------------------------------------------------------
    def tick(self, now: float, assignment: Assignment) -> None:
        """What `Agent.run` does each pass, with the ranks stepped first and the fleet's
        watch standing in for the agent's own: news when the fleet read something new."""
        if assignment is not self._seen:
            self._seen = assignment
            self._on_news()
        self._feed_steps(now)
        exited = self.workers.poll()
        self.pass_once(time.monotonic(), woke=self.wake.is_set(), exited=bool(exited))
        self.wake.clear()

    def publish(self, *, force: bool = False) -> bool:
        started = time.time()
        wrote = super().publish(force=force)
        if wrote:
            self.fleet.status_written(self, started)
        return wrote

    def _feed_steps(self, now: float) -> None:
        """Report what the round's ranks did since the last pass, as each rank's trainer
        would: a `step` message per rank and step, a tier-0 `snapshot` after it, and each
        `checkpoint_every` steps a save -- every rank in its checkpoint phase for `save_s`
        (progress records in and out), global rank 0 committing it. A rank whose peer is
        gone survives it (`survivor`) and waits for the next round in its process."""
        g = self.workers.group
        if g is None:
            return
        world = self.fleet.worlds.get(g.round)
        if world is None:
            return
        cfg = self.fleet.config
        if self._release == g.round:
            world.break_(now)  # they aborted their groups: nobody steps any more
        if world.broken_at is not None and (now >= world.broken_at + cfg.peer_lost_s
                                            or self._release == g.round):
            self._survive(g, world.step(now, cfg.step_time_s))
        last = world.step(now, cfg.step_time_s)
        fed_round, fed = self._fed
        if fed_round != g.round:
            fed, self._saving = world.first_step - 1, None
        alive = [p for p in g.procs.values() if p.returncode is None and not p.survived]
        for step in range(max(fed + 1, last - cfg.window + 1), last + 1):
            self._end_save(alive, world.ended(step, cfg.step_time_s))
            for proc in alive:
                self._on_message(self.fleet.step_report(proc.assignment, step))
                self._on_message({"type": "snapshot", "rank": proc.assignment.rank,
                                  "round": g.round, "step": step,
                                  "path": f"sim://tier0/r{proc.assignment.rank:05d}-s{step}"})
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                    or self.checkpoint_requested):
                self._save(g.round, alive, step, world.ended(step, cfg.step_time_s))
        self._end_save(alive, now)
        self._fed = (g.round, max(fed, last))

    def _save(self, round_: int, alive: list[SimRank], step: int, at: float) -> None:
        """The save of `step`, begun at `at` (wall): each rank into its checkpoint phase;
        global rank 0 commits it."""
        self.checkpoint_requested = False
        if self.fleet.config.report_phases:
            for proc in alive:
                self._on_message(self.fleet.progress(proc.assignment, step, "checkpoint", at))
            self._saving = (step, at + self.fleet.config.save_s)
        if 0 in (p.assignment.rank for p in alive):
            self._commit_checkpoint(round_, step)

    def _end_save(self, alive: list[SimRank], until: float) -> None:
        """The ranks leave the save under way once it has taken `save_s`, by `until`."""
        if self._saving is None or self._saving[1] > until:
            return
        step, at = self._saving
        self._saving = None
        for proc in alive:
            self._on_message(self.fleet.progress(proc.assignment, step + 1, "data", at))

    def _survive(self, g: Group, step: int) -> None:
        """The round's ranks here lost a peer: each aborts its groups, tells its agent it
        survived, and waits (lazarus.trainer.inplace)."""
        for proc in g.procs.values():
            if proc.returncode is None and not proc.survived:
                proc.survived = True
                self._on_message({"type": "survivor", "rank": proc.assignment.rank,
                                  "round": g.round, "pid": proc.pid, "step": step})

    def _commit_checkpoint(self, round_: int, step: int) -> None:
        """Rank 0's side of a save: ask whether its round may commit, then report the commit
        (the agent fences both on run/round)."""
        if self._on_message({"type": "may_commit", "rank": 0, "round": round_, "step": step}
                            ).get("ok"):
            self._on_message({"type": "committed", "rank": 0, "round": round_, "step": step,
                              "path": checkpoint_path(step)})
            self.fleet.count("checkpoint")

    # -- faults ------------------------------------------------------------------------------
    def crash(self, local_rank: int, code: int, now: float) -> None:
        g = self.workers.group
        g.procs[local_rank].exit(code)
        self.fleet.worlds[g.round].break_(now)

    def die(self, now: float) -> None:
        """The node is gone: its agent stops (the lease is no longer refreshed and runs out)
        and its ranks with it."""
        self.dead = True
        if self.session is not None:
            self.fleet.leases.forget(self.session)
        g = self.workers.group
        if g is not None:
            for proc in g.procs.values():
                proc.kill()
            world = self.fleet.worlds.get(g.round)
            if world is not None:
                world.break_(now)


def checkpoint_path(step: int) -> str:
    return f"sim://checkpoints/step-{step}"


def restored_step(path: str | None) -> int:
    """The step of a checkpoint the simulated ranks committed (0: a fresh start)."""
    if not path:
        return 0
    try:
        return int(path.rpartition("-")[2])
    except ValueError:
        return 0


# -- the fleet -----------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """`step_time_s`: a training step of every rank; each step costs the simulator one agent
    message per rank, so thousands of ranks want seconds here. `startup_s`: a round's
    assignment -> its first step (process group init, checkpoint load). `peer_lost_s`: a rank
    lost -> the other ranks of its round survive it. `return_after_s`: a lost node
    comes back (repaired, a new agent) after this long; None: never. `hosts`: threads that
    run the agents' passes, each for its share of the nodes (and so up to that many etcd
    writes in flight). `tick_s`: how often each agent passes; a crash is reported within it.
    `save_s`: how long each rank stays in the checkpoint phase of a save; `report_phases`:
    the ranks report those phases (progress records), as real ranks do -- from the first
    save on, each agent's pass then asks its hang detector, which costs the simulator about
    15 us per node and pass: off for fleets too big for the machine."""
    nodes: int
    spares: int = 0
    nproc: int = 8
    lease_ttl_s: int = settings.LEASE_TTL_S
    status_period_s: float = STATUS_PERIOD_S
    step_time_s: float = 1.0
    startup_s: float = 1.0
    peer_lost_s: float = 0.5
    checkpoint_every: int = 50
    return_after_s: float | None = 30.0
    hosts: int = 48
    tick_s: float = 0.1
    window: int = 20        # steps a rank's agent needs for its throughput summary
    save_s: float = 0.2     # a save's blocking part: short saves cost no status write
    report_phases: bool = True

    def check(self) -> FleetConfig:
        if self.nodes < 1 or self.spares < 0 or self.nproc < 1:
            raise UserError("a fleet needs --nodes >= 1, --nproc >= 1 and --spares >= 0")
        settings.check_lease_ttl(self.lease_ttl_s)
        for name in ("status_period_s", "step_time_s", "tick_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name.removesuffix('_s').replace('_', '-')} must be positive")
        if (self.startup_s < 0 or self.peer_lost_s < 0 or self.checkpoint_every < 0
                or self.save_s < 0):
            raise UserError("startup, peer-lost delay, checkpoint period and save time must "
                            "not be negative")
        if self.hosts < 1:
            raise UserError("a fleet needs at least one host thread")
        return self


@dataclass(slots=True)
class Fault:
    """One injected fault and its timeline (wall times of this process). `seen_at`: when the
    control plane could know -- a crash's failed status going to etcd (its write begun), a
    lost node's lease gone (its registration's delete seen). `committed_at`: the daemon's
    next round seen in run/round. Watch events reach this process behind whatever work it
    has then: timings are as good as the simulator keeps up (Fleet.lag)."""
    kind: str               # "worker_crash" | "node_lost"
    node: str
    round: int
    at: float
    seen_at: float | None = None
    committed_at: float | None = None
    new_round: int | None = None
    running_at: float | None = None

    @property
    def decision_s(self) -> float | None:
        if self.seen_at is None or self.committed_at is None:
            return None
        return self.committed_at - self.seen_at

    @property
    def total_s(self) -> float | None:
        return None if self.committed_at is None else self.committed_at - self.at


class _Host(threading.Thread):
    """Runs the passes of a share of the fleet's agents, one after the other, every tick."""

    def __init__(self, fleet: Fleet, index: int):
        super().__init__(daemon=True, name=f"fleet-host-{index}")
        self.fleet = fleet
        self.agents: list[SimAgent] = []
        self.stop_event = threading.Event()
        self.slowest_s = 0.0  # the longest pass over its agents: how late any of them acts

    def run(self) -> None:
        fleet, cfg = self.fleet, self.fleet.config
        outage = E.OutageLog(fleet.etcd, log, "the simulated ranks keep training")
        while not self.stop_event.is_set():
            started = time.monotonic()
            assignment = fleet.follower.current
            for i, agent in enumerate(self.agents):
                now = time.time()
                if agent.dead:
                    if fleet.due_back(agent, now):
                        self.agents[i] = agent = fleet.new_agent(agent.cfg.node, agent.cfg.role)
                    else:
                        continue
                try:
                    agent.tick(now, assignment)
                    outage.ok()
                except E.EtcdUnavailable as e:
                    outage.failed(e)
            took = time.monotonic() - started
            self.slowest_s = max(self.slowest_s, took)
            self.stop_event.wait(max(0.0, cfg.tick_s - took))


class Fleet:
    """`config.nodes` active and `config.spares` spare simulated nodes against the etcd that
    `etcd` talks to (and the daemon watching it), under `keys`. Names: n00000..., s00000...
    `scratch`: a directory the agents' worker bookkeeping may touch (it unlinks exit notes
    there that never exist)."""

    def __init__(self, etcd: E.Etcd, keys: Keys, config: FleetConfig, *, scratch: Path,
                 seed: int = 0):
        self.etcd, self.keys, self.config = etcd, keys, config.check()
        self.scratch = scratch
        scratch.mkdir(parents=True, exist_ok=True)
        self.leases = Leases(etcd, config.lease_ttl_s)
        self.follower = RunFollower(etcd, keys)
        self.worlds: dict[int, World] = {}
        self.faults: list[Fault] = []
        self.random = random.Random(seed)
        self._lock = threading.Lock()
        self._pid = _FIRST_PID
        self._port = 20000
        self._back_at: dict[str, float] = {}
        self._counts: Counter = Counter()
        # thousands of agents' lines; the levels come back at stop() (a test after the fleet
        # in the same process counts the agent's warnings)
        self._levels = {}
        for name in ("lazarus.agent", "lazarus.agent.workers", "lazarus.agent.health",
                     "lazarus.agent.gpu"):
            self._levels[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(logging.ERROR)
        self._hosts = [_Host(self, i) for i in range(min(config.hosts, config.nodes + config.spares))]
        names = ([(f"n{i:05d}", ROLE_ACTIVE) for i in range(config.nodes)]
                 + [(f"s{i:05d}", ROLE_SPARE) for i in range(config.spares)])
        self.agents: dict[str, SimAgent] = {}
        for i, (node, role) in enumerate(names):
            agent = self.new_agent(node, role)
            self._hosts[i % len(self._hosts)].agents.append(agent)

    # -- bookkeeping the agents call ---------------------------------------------------------
    def new_agent(self, node: str, role: str) -> SimAgent:
        agent = SimAgent(self, node=node, role=role)
        with self._lock:
            self.agents[node] = agent
            self._back_at.pop(node, None)
        return agent

    def next_pid(self) -> int:
        with self._lock:
            self._pid += 1
            return self._pid

    def next_port(self) -> int:
        with self._lock:
            self._port += 1
            return self._port

    def join(self, a: WorkerAssignment) -> None:
        now = time.time()
        with self._lock:
            world = self.worlds.get(a.round)
            if world is None:
                world = self.worlds[a.round] = World(
                    a.round, a.world_size, startup_s=self.config.startup_s,
                    first_step=max(a.restore_step, restored_step(a.restore)) + 1)
                for old in [r for r in self.worlds if r < a.round - 2]:
                    del self.worlds[old]
            world.join(now)

    def step_report(self, a: WorkerAssignment, step: int) -> dict:
        """A rank's `step` message, shaped as the trainer sends it (lazarus.trainer.train):
        the step's wall time, the rank's own work in it (with a little noise, none of it a
        straggler's), the global batch's tokens and its data window."""
        cfg = self.config
        batch = int(a.train.get("data", {}).get("global_batch", 1))
        noise = 0.96 + ((a.rank * 7919 + step * 104729) % 1000) / 12500.0
        return {"type": "step", "rank": a.rank, "round": a.round, "step": step,
                "loss": 4.0 / (1.0 + step / 1000.0), "grad_norm": 1.0, "lr": 3e-4,
                "tokens": batch * 1024, "step_time_s": cfg.step_time_s, "skipped": False,
                "compute_s": cfg.step_time_s * 0.9 * noise,
                "window": [(step - 1) * batch, step * batch - 1]}

    def progress(self, a: WorkerAssignment, step: int, phase: str, at: float) -> dict:
        """A rank's `progress` record (lazarus.trainer.session.progress): it entered `phase`
        of `step` at `at` (a wall time; the record carries this host's monotonic clock)."""
        return {"type": "progress", "rank": a.rank, "round": a.round, "step": step,
                "phase": phase, "seq": step, "op": "",
                "since": time.monotonic() - (time.time() - at)}

    def status_written(self, agent: SimAgent, started: float) -> None:
        """`agent` wrote its status; its write began at `started`. That is when a crash
        counts as seen: the write's return reaches a thread of this busy process later than
        etcd's watchers (the daemon) see the write."""
        with self._lock:
            self._counts["status"] += 1
            for f in self.faults:
                if (f.seen_at is None and f.kind == "worker_crash" and f.node == agent.cfg.node
                        and agent.publisher.state[0] == W_FAILED):
                    f.seen_at = started

    def count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def counts(self) -> Counter:
        with self._lock:
            return Counter(self._counts)

    def lag(self) -> tuple[float, float]:
        """How far the simulator fell behind the fleet it simulates, at worst: (the slowest
        pass over a host's agents, the latest lease renewal round). Both are well under the
        lease TTL when the figures measure the control plane rather than this machine."""
        return max(h.slowest_s for h in self._hosts), self.leases.late

    def reset_lag(self) -> None:
        for h in self._hosts:
            h.slowest_s = 0.0
        self.leases.late = 0.0

    def due_back(self, agent: SimAgent, now: float) -> bool:
        with self._lock:
            at = self._back_at.get(agent.cfg.node)
        return at is not None and now >= at

    # -- running -----------------------------------------------------------------------------
    def start(self) -> None:
        self.leases.start()
        self.follower.start()
        for h in self._hosts:
            h.start()

    def stop(self, *, revoke: bool = True) -> None:
        """Stop every agent; `revoke`: their leases too (the nodes leave at once), else they
        run out within a TTL."""
        for h in self._hosts:
            h.stop_event.set()
        for h in self._hosts:
            if h.ident is not None:  # a start that failed (etcd away) left some unstarted
                h.join(timeout=10)
        self.follower.stop()
        self.leases.stop()
        if revoke:
            for agent in self.agents.values():
                if agent.session is not None and not agent.dead:
                    agent.session.close(revoke=True)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)

    @property
    def status(self) -> RunStatus | None:
        return self.follower.current.status

    def wait_running(self, *, round_after: int = 0, timeout_s: float = 120.0) -> RunStatus:
        a = self.follower.wait(lambda a: a.status is not None and a.status.state == RUNNING
                               and a.status.round > round_after, timeout_s,
                               f"the run RUNNING in a round after {round_after}")
        return a.status

    def members(self) -> list[str]:
        st = self.status
        return list(st.members) if st is not None and st.state in (RENDEZVOUS, RUNNING) else []

    # -- faults ------------------------------------------------------------------------------
    def _victim(self, node: str | None) -> SimAgent:
        members = self.members()
        if not members:
            raise RuntimeError("no round is running: nothing to inject a fault into")
        node = node or self.random.choice(members)
        agent = self.agents[node]
        if agent.dead or agent.workers.group is None:
            raise RuntimeError(f"{node} runs no ranks now")
        return agent

    def crash(self, node: str | None = None, *, code: int = CRASH_EXIT) -> Fault:
        """A rank of `node` (a random member by default) dies with `code`; its agent reports
        it at its next pass, and the round's other ranks survive it after peer_lost_s."""
        agent = self._victim(node)
        g = agent.workers.group
        now = time.time()
        fault = Fault("worker_crash", agent.cfg.node, g.round, now)
        with self._lock:
            self.faults.append(fault)
        agent.crash(self.random.randrange(len(g.procs)), code, now)
        return fault

    def lose_node(self, node: str | None = None) -> Fault:
        """`node` (a random member by default) dies: agent and ranks. Its lease runs out one
        TTL later; it comes back as a new agent after return_after_s."""
        agent = self._victim(node)
        now = time.time()
        fault = Fault("node_lost", agent.cfg.node, agent.workers.group.round, now)
        with self._lock:
            self.faults.append(fault)
            if self.config.return_after_s is not None:
                self._back_at[agent.cfg.node] = now + self.config.return_after_s
        agent.die(now)
        return fault

    def resolve(self, fault: Fault) -> Fault:
        """Fill in what the watches saw of `fault` so far: the lost node's registration gone,
        the next round committed, the run RUNNING again."""
        f = self.follower
        if fault.kind == "node_lost" and fault.seen_at is None:
            fault.seen_at = next((t for t in f.node_gone.get(fault.node, []) if t >= fault.at),
                                 None)
        if fault.committed_at is None:
            got = next(((t, r) for t, r in list(f.round_commits)
                        if r > fault.round and t >= fault.at), None)
            if got is not None:
                fault.committed_at, fault.new_round = got
        return fault

    def wait_recovered(self, fault: Fault, *, timeout_s: float = 120.0) -> Fault:
        """Until the round after `fault` is committed and RUNNING; the fault, resolved."""
        self.follower.wait(lambda _a: self.resolve(fault).committed_at is not None, timeout_s,
                           f"a new round after the {fault.kind} of {fault.node}")
        st = self.wait_running(round_after=fault.round, timeout_s=timeout_s)
        fault.running_at = time.time()
        if st.round != fault.new_round:
            fault.new_round = st.round
        return self.resolve(fault)


def describe(faults: Iterable[Fault]) -> str:
    lines = []
    for f in faults:
        seen = f"seen +{f.seen_at - f.at:.2f} s" if f.seen_at else "not seen"
        decision = "-" if f.decision_s is None else f"{f.decision_s:.3f} s"
        done = (f"round {f.new_round} committed +{f.total_s:.2f} s (decision {decision})"
                if f.committed_at else "no new round")
        lines.append(f"{f.kind} of {f.node} in round {f.round}: {seen}, {done}")
    return "\n".join(lines)
