"""`lazarus agent`: one per node. Registers the node under a lease, hosts the rendezvous store,
keeps warm parked workers, runs the workers of the round it is assigned, and reports.

The agent is level-triggered like the daemon: each pass reads run/status and the current
round record and converges its workers on them (start the round's workers, or kill workers of
a round that is over). It never decides membership; it obeys the round record.

While etcd is unreachable the workers keep training: nothing here kills a worker because etcd
is away. Checkpoint commits need etcd (they are fenced on the round), so none commit then.

Shaped like the daemon: `Agent` owns the state and the loop and observes (its ranks, the hang
detector, its assignment in etcd); what a pass does about it is decided purely in
lazarus.agent.decide and done by thin executors: lazarus.agent.rounds (start and stop a
round's ranks, hand them over between agents), lazarus.agent.hangreport (a hang's stacks),
lazarus.agent.nodestatus (the status written). The ranks' messages on the worker channel are
lazarus.agent.messages'; the command line is lazarus.agent.cli's.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path

from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core.errors import UserError
from lazarus.core.records import (RENDEZVOUS, ROLE_ACTIVE, ROLE_SPARE, RUNNING, Keys,
                                  NodeRecord, NodeStatus, RoundRecord, RunStatus)
from lazarus.agent import decide, hangreport, messages, nodestatus, preflight_agent, rounds
from lazarus.agent.assignment import Assignment, read as read_assignment, readable
from lazarus.agent.adopt import Left, NodeLock, forget, record_path
from lazarus.agent.channel import Channel
from lazarus.agent.hang import HangConfig, HangDetector
from lazarus.agent.roundreport import RoundReport
from lazarus.core.contract import (AGENT_GRACE_ENV, PROGRESS_ENV, STACKS_ENV,
                                   SCRIPT_PG_TIMEOUT_ENV, without_secrets)
from lazarus.core import rankfiles
from lazarus.core.jobuser import JobUser, job_dir
from lazarus.core.privatedir import private_dir
from lazarus.core.throughput import ThroughputTracker
from lazarus.agent.health import NodeHealth
from lazarus.agent.netif import collective_env
from lazarus.agent import collective_check as coll
from lazarus.agent import preflight as pre
from lazarus.agent.stacks import FLIGHT_ENTRIES, flight_recorder_env
from lazarus.agent.workers import RANK_LOG_BYTES, Workers
from lazarus.agent.tier0_agent import Tier0, Tier0Options

log = logging.getLogger("lazarus.agent")

# Node status is written at once on a change of state (workers, health, a hang, a long phase,
# a spike), else at most once a period while the step moves, with the throughput summary: the
# write budget (docs/architecture.md, "Write budget") is 0.1 writes/s per node in steady
# state. Liveness is the lease alone; nothing reads the age of a status as a sign of life.
STATUS_PERIOD_S = 15.0
# The agent converges its workers on its assignment (run/status and the round record) this
# often, and at once when something wakes it ...
RECONCILE_S = 0.5
# ... but reads the assignment from etcd only on news, else every REREAD_S
# (lazarus.agent.assignment).
# How often the ranks' log files are held to their size (lazarus.agent.workers.bound_logs): a
# rank writes at most a few MB a second.
LOG_CHECK_S = 5.0
# An idle node repeats its preflight checks this often (docs/operations.md, "Preflight").
PREFLIGHT_EVERY_S = 600.0
# Ranks whose agent is gone wait one lease TTL and this much for the next one before they
# stop (lazarus.agent.adopt): an agent back within the TTL still needs a moment to listen.
ORPHAN_MARGIN_S = 5.0


def _round_over(round_: int, status: RunStatus | None) -> bool:
    return status is None or status.round != round_ or status.state not in (RENDEZVOUS,
                                                                             RUNNING)


class Agent:
    """`lease_ttl_s`: how long after this agent dies the daemon declares the node lost. Must be
    longer than a stall of this process (GC, swap), or a live node gets evicted.
    `status_period_s`: how stale the step and throughput in the node status may get while
    nothing else changes; a straggler is seen up to this much later.
    `preflight_every_s`: how often a node that runs no ranks repeats its preflight checks
    (lazarus.agent.preflight; 0: only when the agent starts; None: never, and the node takes
    work without them). A failure found there keeps the node out of rounds until a later
    run passes, so this is also how long a fixed node waits to be used again."""

    def __init__(self, etcd: E.Etcd, keys: Keys, *, node: str, nproc: int, role: str,
                 workdir: Path, host: str = "127.0.0.1", lease_ttl_s: int = settings.LEASE_TTL_S,
                 park: bool = True, gpu_backend: str = "auto",
                 gpu_faults: Path | None = None, hang_config: HangConfig | None = None,
                 host_limits: dict | None = None, monitors: bool = True,
                 status_period_s: float = STATUS_PERIOD_S,
                 preflight_every_s: float | None = PREFLIGHT_EVERY_S,
                 tier0: Tier0Options | None = None,
                 allowed_roots: list[str] | None = None,
                 flight_entries: int = FLIGHT_ENTRIES, rank_log_bytes: int = RANK_LOG_BYTES,
                 run_as: JobUser | None = None):
        """`allowed_roots`: where jobs may have this node's ranks write (lazarus.core.jobpaths);
        None: anywhere (`lazarus agent` always passes a list: its --allowed-root, else its
        workdir). `flight_entries`: the collectives torch's flight recorder keeps per process
        group of a rank; 0 turns it off. `run_as`: the user the ranks run as, when not
        this process's (lazarus.core.jobuser; the caller checked this process may)."""
        if role not in (ROLE_ACTIVE, ROLE_SPARE):
            raise UserError(f"--role must be {ROLE_ACTIVE} or {ROLE_SPARE}, not {role!r}")
        if not node or "/" in node:
            raise UserError(f"--node {node!r}: a node id is a non-empty name without '/'")
        self._init_state(etcd, keys, node=node, nproc=nproc, role=role, host=host,
                         lease_ttl_s=lease_ttl_s, status_period_s=status_period_s,
                         workdir=workdir, monitors=monitors,
                         hangs=HangDetector(hang_config or HangConfig()))
        self.allowed_roots = [str(r) for r in allowed_roots or ()]
        self.run_as = run_as
        job_gid = run_as.gid if run_as else None
        private_dir(workdir, "--workdir", pass_gid=job_gid)
        if run_as is not None:
            # What the ranks write, theirs; the agent's directories above, to pass through.
            rankfiles.trust(run_as.uid)
            for sub in ("stacks", "logs"):
                private_dir(workdir / sub, "--workdir", pass_gid=job_gid)
                run_as.give(workdir / sub / node)
            for sub in ("nccl", "nccl-pipes"):  # the flight recorder's, in theirs
                run_as.give(workdir / "stacks" / node / sub, in_theirs=True)
            run_as.give(job_dir(workdir))
            if not run_as.can_pass(job_dir(workdir)):
                raise UserError(f"--run-as {run_as.name}: that user cannot reach --workdir "
                                f"{workdir} (a directory above it is closed to it); give a "
                                f"workdir it can pass through")
        self._node_lock = NodeLock(workdir / f"{node}.lock", node)
        # Ranks a previous agent of this node left running (lazarus.agent.adopt). Their lease
        # is resumed first, before the slow start-up below: the node must not lapse meanwhile.
        self._left_path = record_path(workdir, node)
        left = Left.load(self._left_path)
        self._resume_lease = left.lease if left is not None else None
        if left is not None:
            try:
                self._new_session()
            except E.EtcdUnavailable:
                pass  # register() tries again
        self.health = NodeHealth(gpu_backend=gpu_backend, gpus=nproc,
                                 fault_script=gpu_faults or workdir / f"{node}.gpu-faults.json",
                                 host_limits=host_limits)
        sock = str(workdir / f"{node}.sock")
        # The ranks run the job's code: none of this process's secrets (an API token, etcd
        # credentials) go to them.
        env = {**without_secrets(os.environ),
               **(run_as.env(fallback_home=job_dir(workdir)) if run_as else {}),
               "LAZARUS_AGENT_SOCKET": sock, "LAZARUS_NODE": node,
               STACKS_ENV: str(workdir / "stacks" / node),
               AGENT_GRACE_ENV: str(lease_ttl_s + ORPHAN_MARGIN_S),
               **collective_env(host, dict(os.environ)),
               **settings.rank_threads_env(nproc),
               # what each process group's collectives were when a round hangs
               **flight_recorder_env(workdir / "stacks" / node, entries=flight_entries),
               SCRIPT_PG_TIMEOUT_ENV: str(2 * self.hangs.config.first_step_timeout_s)}
        if not monitors:
            env[PROGRESS_ENV] = "off"
        self.stacks_dir = workdir / "stacks" / node
        self.workers = Workers(nproc=nproc, env=env, log_dir=workdir / "logs" / node,
                               notes_dir=self.stacks_dir, park=park, log_bytes=rank_log_bytes,
                               user=run_as)
        if left is not None:
            rounds.take_over(self, left)
        # Listening before the store's slow import: adopted ranks reconnect at once.
        self.channel = Channel(sock, on_message=self._on_message,
                               admit=functools.partial(messages.admits, self),
                               job_user=run_as)
        if tier0 is not None:
            self.tier0 = Tier0(node=node, host=host, options=tier0, lookup=self._node_record,
                               on_kept=functools.partial(messages.snapshot_kept, self),
                               user=run_as)
        import torch.distributed as dist  # the agent hosts a round's store when it is first

        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if preflight_every_s is not None and monitors:
            self.preflight = pre.Runner(every_s=preflight_every_s,
                                        run=functools.partial(preflight_agent.checks, self),
                                        on_done=self.wake.set)
            # idle nodes' collective tests against this one (lazarus.agent.collective_check)
            self.peer_tests = coll.PeerTests(self.store, host=host, port=self.store.port)

    def _init_state(self, etcd: E.Etcd, keys: Keys, *, node: str, nproc: int, role: str,
                    host: str, lease_ttl_s: int, status_period_s: float, workdir: Path,
                    monitors: bool, hangs: HangDetector) -> None:
        """Everything the agent decides with, and nothing that is a process, a socket or a
        device: the fleet simulator (lazarus.sim.fleet) builds its agents with this alone,
        so that they cannot drift from this one."""
        self.etcd, self.keys = etcd, keys
        self.node, self.nproc, self.role, self.host = node, nproc, role, host
        self.lease_ttl_s = lease_ttl_s
        self.status_period_s = status_period_s
        self.workdir = workdir
        # False (--monitors off) only to measure what the monitors cost: no GPU, host, hang
        # or throughput monitoring here, and no progress reports from the workers.
        self.monitors = monitors
        self.allowed_roots: list[str] = []  # no limit (see __init__)
        self.run_as: JobUser | None = None  # the ranks run as the agent's user
        self.session: E.Session | None = None
        self.wake = threading.Event()
        self._over_since: tuple[int, float] | None = None  # (round, when) its end was seen
        self._resume_lease: int | None = None
        self._registered = False            # the node record names this process
        self._lock = threading.Lock()       # guards what the channel's thread updates
        # what this node's ranks of the current round reported; a launch replaces it
        self.report = RoundReport()
        self.hangs = hangs
        self.throughput = ThroughputTracker()
        self._next_log_check = 0.0
        self._round_stores: dict = {}       # round -> the store this node hosts for it
        self._adopted_round: int | None = None  # until its old node status is read back
        self._checkpoint_request: bytes | None = None
        self._unreadable: dict[str, int] = {}  # key -> mod revision of the value named
        self.publisher = nodestatus.Publisher(node, status_period_s)
        self._watches: list[E.Watch] = []
        self.outage = E.OutageLog(etcd, log, "workers keep training")
        # the assignment (run/status, the round record), read on news from the watches
        self.assignments = Assignment(self._read_assignment)
        self._next_reconcile = 0.0
        self.preflight: pre.Runner | None = None
        self.peer_tests: coll.PeerTests | None = None
        self.tier0: Tier0 | None = None     # in-memory snapshots (lazarus.agent.tier0_agent)

    # -- registration ------------------------------------------------------------------------
    def _new_session(self) -> None:
        self.session = E.Session(self.etcd, ttl_s=self.lease_ttl_s, on_lost=self.wake.set,
                                 resume=self._resume_lease)
        if self._resume_lease is not None:
            log.info("lease %x of the previous agent %s", self._resume_lease,
                     "resumed: no node loss" if self.session.resumed else
                     "had expired: the node was lost; a new lease")
        self._resume_lease = None  # only a predecessor's lease, and only once
        self._registered = False

    def register(self) -> None:
        if self.session is None or self.session.lost.is_set():
            self._new_session()
        if self._registered:
            return
        assert self.session is not None
        rec = NodeRecord(node=self.node, host=self.host, nproc=self.nproc, role=self.role,
                         store_port=self.store.port, pid=os.getpid(), started_at=time.time(),
                         gpu_backend=self.health.backend_name, lease_ttl_s=self.lease_ttl_s,
                         preflight=self.preflight is not None,
                         replica_port=self.tier0.port if self.tier0 is not None else 0)
        try:
            self.etcd.put(self.keys.node_key(self.node), rec.to_json(), lease=self.session.lease)
        except E.LeaseLost:
            self.session.mark_lost()
            raise E.EtcdUnavailable("lease lost while registering; retrying") from None
        self._registered = True
        self.publisher.state = None  # the new lease has no status key yet
        self._save_left()  # it names the lease
        log.info("registered %s (%s, %d ranks, store port %d)", self.node, self.role,
                 self.nproc, self.store.port)

    # -- the worker channel (lazarus.agent.messages) ---------------------------------------
    def _on_message(self, msg: dict) -> dict | None:
        return messages.on_message(self, msg)

    def _node_record(self, node: str) -> NodeRecord | None:
        """A node's registration as etcd has it now (where its agent takes tier-0 copies)."""
        kv = self.etcd.get(self.keys.node_key(node))
        return readable(self._unreadable, NodeRecord, kv) if kv is not None else None

    # -- the assignment ----------------------------------------------------------------------
    def _read_assignment(self) -> tuple[RunStatus | None, RoundRecord | None]:
        return read_assignment(self.etcd, self.keys, self._unreadable,
                               self._pass_on_checkpoint_request)

    def _pass_on_checkpoint_request(self, kv: E.KV | None) -> None:
        messages.pass_on_checkpoint_request(self, kv)

    def _on_news(self, _events: object = None) -> None:
        """A watch on run/ or commands/ delivered (or resynced): read the assignment again."""
        self.assignments.news()
        self.wake.set()

    # -- converging on it (lazarus.agent.decide, lazarus.agent.rounds) -----------------------
    def reconcile(self, now: float | None = None) -> None:
        self.register()
        status, rec = self.assignments.get(time.monotonic() if now is None else now)
        self._see_round_end(status)
        for action in decide.converge(self.node, status, rec, self._local(status)):
            rounds.act(self, action)

    def _see_round_end(self, status: RunStatus | None) -> None:
        """Note when the assignment first showed the running group's round over (or forget
        it when it is not): how long ago that was is part of the view (`_local`)."""
        g = self.workers.group
        if g is None or not _round_over(g.round, status):
            self._over_since = None
        elif self._over_since is None or self._over_since[0] != g.round:
            self._over_since = (g.round, time.monotonic())

    def _local(self, status: RunStatus | None = None) -> decide.Local:
        """What this node's ranks are doing, as the pure decisions take it; reads only.
        `status`: the run's, for how long their round has been over (0 without it)."""
        g = self.workers.group
        kept = bool(self.workers.kept)
        if g is None:
            return decide.Local(kept=kept)
        with self._lock:
            alive = {lr for lr, p in g.procs.items() if lr not in g.exit_codes
                     and p.poll() is None}
            survivors = frozenset(g.survivors & alive)
        since = self._over_since
        over_s = (time.monotonic() - since[1]
                  if status is not None and since is not None and since[0] == g.round
                  and _round_over(g.round, status) else 0.0)
        return decide.Local(g.round, g.alive, survivors, kept, waiting=bool(alive - survivors),
                            over_s=over_s)

    def _check_hang(self, now: float) -> None:
        """Ask the hang detector while the ranks run; report a hang with their stacks, taken
        before anything is killed, or withdraw the report (lazarus.agent.decide.hang)."""
        local = self._local()
        verdict = None
        if local.alive:
            with self._lock:
                verdict = self.hangs.check(now)
        for action in decide.hang(local, verdict, reported=self.report.hang is not None):
            hangreport.act(self, self.workers.group, action)

    def _host_round_store(self, rec: RoundRecord) -> None:
        rounds.host_round_store(self, rec)

    # -- ranks that outlive this agent (lazarus.agent.adopt, lazarus.agent.rounds) -----------
    def _save_left(self) -> None:
        rounds.save_left(self)

    # -- status (lazarus.agent.nodestatus) ---------------------------------------------------
    def node_status(self) -> NodeStatus:
        return nodestatus.build(self)

    def publish(self, *, force: bool = False) -> bool:
        """Write node status on a change of state at once, else at most once a (jittered)
        period while the step moves. True when it wrote."""
        state = nodestatus.state(self)
        now = time.time()
        if not self.publisher.due(now, state, self.report.step["step"], force=force):
            return False
        return nodestatus.write(self, state, now)

    # -- main loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.workers.refill()
        rev = 0
        while not stop.is_set() and not rev:
            try:
                self.register()
                rounds.resume_status(self)
                rev = self.etcd.snapshot([self.keys.root + "run/"]).revision
            except E.EtcdUnavailable as e:
                self.outage.failed(e)
                stop.wait(1.0)
        self._watches = [
            self.etcd.watch_prefix(prefix, start_revision=rev + 1, on_events=self._on_news,
                                   on_resync=self._resync)
            for prefix in (self.keys.root + "run/", self.keys.root + "commands/")]
        while not stop.is_set():
            woke = self.wake.wait(0.1)
            self.wake.clear()
            exited = self.workers.poll()
            try:
                self.pass_once(time.monotonic(), woke=woke, exited=bool(exited))
                self.outage.ok()
            except E.EtcdUnavailable as e:
                self.outage.failed(e)
                away = time.monotonic() - self.outage.since  # set by failed()
                for action in decide.cut_off(self._local(), away, self.lease_ttl_s):
                    rounds.act(self, action)
                stop.wait(0.5)
        for w in self._watches:
            w.cancel()
        self.shutdown()

    def _resync(self) -> int:
        """A watch whose history was compacted away resumes from now; what it missed is
        read with the assignment."""
        rev = self.etcd.revision(self.keys.root) + 1
        self._on_news()
        return rev

    def pass_once(self, now: float, *, woke: bool, exited: bool) -> None:
        """One pass of the run loop, after the workers were polled (`exited`: one of them
        exited since the last pass): look for a hang, converge on the assignment on news or
        every RECONCILE_S, write the status when it is due."""
        if self.monitors:
            self._check_hang(now)
        if woke or exited or now >= self._next_reconcile:
            self.reconcile(now)
            self._next_reconcile = now + RECONCILE_S
            if self.peer_tests is not None:
                self.peer_tests.poll()
        if now >= self._next_log_check:
            self.workers.bound_logs()
            self._next_log_check = now + LOG_CHECK_S
        self.publish(force=exited)
        if self.preflight is not None:
            g = self.workers.group
            self.preflight.poll(now, idle=g is None or not g.alive)

    def shutdown(self) -> None:
        """Stop. Ranks still training are left running for the next agent of this node (an
        upgrade is a stop and a start), under the lease, which is kept: refreshed once more
        here, it gives the next agent a whole TTL to come back. Otherwise the lease is revoked
        and the node leaves at once."""
        g = self.workers.group
        leave = g is not None and g.alive
        self.workers.shutdown(leave_ranks=leave)
        self.health.close()
        self.channel.close()
        if self.tier0 is not None:
            self.tier0.close()
        if not leave:
            forget(self._left_path)
        if self.session is not None:
            if leave:
                try:
                    self.etcd.refresh(self.session.lease)
                except (E.EtcdUnavailable, E.LeaseLost):
                    pass
                log.info("leaving round %d ranks (pids %s) running: an agent of %s back within "
                         "%d s adopts them, else they stop by themselves", g.round,
                         " ".join(map(str, g.pids())), self.node, self.lease_ttl_s)
            self.session.close(revoke=not leave)
        self._node_lock.release()
