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
lazarus.agent.messages'; the command line is lazarus.agent.cli's. What the agent is told is
one value (lazarus.agent.agentconfig), what it drives goes through its ports
(lazarus.agent.ports), so the fleet simulator and the tests build this same class.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

from lazarus.core import etcd as E
from lazarus.core.records import (RENDEZVOUS, RUNNING, Keys, NodeRecord, NodeStatus,
                                  RoundRecord, RunStatus)
from lazarus.agent import decide, hangreport, messages, nodestatus, preflight_agent, rounds
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.assignment import Assignment, readable
from lazarus.agent.hang import HangDetector
from lazarus.agent.ports import ORPHAN_MARGIN_S, NodePorts, Ports
from lazarus.agent.roundreport import RoundReport
from lazarus.core.throughput import ThroughputTracker

log = logging.getLogger("lazarus.agent")

# The agent converges its workers on its assignment (run/status and the round record) this
# often, and at once when something wakes it ...
RECONCILE_S = 0.5
# ... but reads the assignment from etcd only on news, else every REREAD_S
# (lazarus.agent.assignment).
# How often the ranks' log files are held to their size (lazarus.agent.workers.bound_logs): a
# rank writes at most a few MB a second.
LOG_CHECK_S = 5.0


def _round_over(round_: int, status: RunStatus | None) -> bool:
    return status is None or status.round != round_ or status.state not in (RENDEZVOUS,
                                                                             RUNNING)


class Agent:
    """One node's agent: `config` says what it is (lazarus.agent.agentconfig), `ports` what
    it drives (lazarus.agent.ports; a real node's unless given: the fleet simulator and the
    tests give their own, and build this same class)."""

    def __init__(self, etcd: E.Etcd, keys: Keys, config: AgentConfig,
                 ports: Ports | None = None):
        self.etcd, self.keys, self.cfg = etcd, keys, config
        self.ports = ports if ports is not None else NodePorts(config)
        self.wake = threading.Event()
        self._lock = threading.Lock()       # guards what the channel's thread updates
        # what this node's ranks of the current round reported; a launch replaces it
        self.report = RoundReport()
        self.hangs = HangDetector(config.hang)
        self.throughput = ThroughputTracker()
        self.publisher = nodestatus.Publisher(config.node, config.status_period_s)
        self.outage = E.OutageLog(etcd, log, "workers keep training")
        # the assignment (run/status, the round record), read on news from the watches
        self.assignments = Assignment(self._read_assignment)
        self._unreadable: dict[str, int] = {}  # key -> mod revision of the value named
        self._checkpoint_request: bytes | None = None
        self._over_since: tuple[int, float] | None = None  # (round, when) its end was seen
        self._due = {"reconcile": 0.0, "logs": 0.0}  # when a pass next does each
        self.session: E.Session | None = None
        self._registered = False            # the node record names this process
        # Ranks a previous agent of this node left running (lazarus.agent.adopt). Their lease
        # is resumed first, before the slow start-up below: the node must not lapse meanwhile.
        left = self.ports.left()
        self._resume_lease = left.lease if left is not None else None
        if left is not None:
            try:
                self._new_session()
            except E.EtcdUnavailable:
                pass  # register() tries again
        self.health = self.ports.health()
        self.workers = self.ports.workers(
            agent_grace_s=config.lease_ttl_s + ORPHAN_MARGIN_S,
            script_pg_timeout_s=2 * self.hangs.config.first_step_timeout_s)
        if left is not None:
            rounds.take_over(self, left)
        # Listening before the store's slow import: adopted ranks reconnect at once.
        self.channel = self.ports.channel(on_message=self._on_message,
                                          admit=functools.partial(messages.admits, self))
        self.tier0 = self.ports.tier0(lookup=self._node_record,
                                      on_kept=functools.partial(messages.snapshot_kept, self))
        self.store = self.ports.store()
        self.preflight, self.peer_tests = self.ports.preflight(
            run=functools.partial(preflight_agent.checks, self), on_done=self.wake.set,
            store=self.store)

    # -- registration ------------------------------------------------------------------------
    def _new_session(self) -> None:
        self.session = self.ports.session(self.etcd, ttl_s=self.cfg.lease_ttl_s,
                                          on_lost=self.wake.set, resume=self._resume_lease)
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
        c = self.cfg
        rec = NodeRecord(node=c.node, host=c.host, nproc=c.nproc, role=c.role,
                         store_port=self.store.port, pid=os.getpid(), started_at=time.time(),
                         gpu_backend=self.health.backend_name, lease_ttl_s=c.lease_ttl_s,
                         preflight=self.preflight is not None,
                         replica_port=self.tier0.port if self.tier0 is not None else 0)
        try:
            self.etcd.put(self.keys.node_key(c.node), rec.to_json(), lease=self.session.lease)
        except E.LeaseLost:
            self.session.mark_lost()
            raise E.EtcdUnavailable("lease lost while registering; retrying") from None
        self._registered = True
        self.publisher.state = None  # the new lease has no status key yet
        rounds.save_left(self)  # it names the lease
        log.info("registered %s (%s, %d ranks, store port %d)", c.node, c.role, c.nproc,
                 self.store.port)

    # -- the worker channel (lazarus.agent.messages) ---------------------------------------
    def _on_message(self, msg: dict) -> dict | None:
        return messages.on_message(self, msg)

    def _node_record(self, node: str) -> NodeRecord | None:
        """A node's registration as etcd has it now (where its agent takes tier-0 copies)."""
        kv = self.etcd.get(self.keys.node_key(node))
        return readable(self._unreadable, NodeRecord, kv) if kv is not None else None

    # -- the assignment ----------------------------------------------------------------------
    def _read_assignment(self) -> tuple[RunStatus | None, RoundRecord | None]:
        return self.ports.read_assignment(
            self.etcd, self.keys, self._unreadable,
            functools.partial(messages.pass_on_checkpoint_request, self))

    def _on_news(self, _events: object = None) -> None:
        """A watch on run/ or commands/ delivered (or resynced): read the assignment again."""
        self.assignments.news()
        self.wake.set()

    # -- converging on it (lazarus.agent.decide, lazarus.agent.rounds) -----------------------
    def reconcile(self, now: float | None = None) -> None:
        self.register()
        status, rec = self.assignments.get(time.monotonic() if now is None else now)
        self._see_round_end(status)
        for action in decide.converge(self.cfg.node, status, rec, self._local(status)):
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
                            over_s=over_s, rank_round=g.rank_round, succeeded=g.succeeded)

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
        watches = [
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
                for action in decide.cut_off(self._local(), away, self.cfg.lease_ttl_s):
                    rounds.act(self, action)
                stop.wait(0.5)
        for w in watches:
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
        if self.cfg.monitors:
            self._check_hang(now)
            with self._lock:
                messages.track_long_phase(self)
        if woke or exited or now >= self._due["reconcile"]:
            self.reconcile(now)
            self._due["reconcile"] = now + RECONCILE_S
            if self.peer_tests is not None:
                self.peer_tests.poll()
        if now >= self._due["logs"]:
            self.workers.bound_logs()
            self._due["logs"] = now + LOG_CHECK_S
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
            self.ports.save_left(None)
        if self.session is not None:
            if leave:
                try:
                    self.etcd.refresh(self.session.lease)
                except (E.EtcdUnavailable, E.LeaseLost):
                    pass
                log.info("leaving round %d ranks (pids %s) running: an agent of %s back within "
                         "%d s adopts them, else they stop by themselves", g.round,
                         " ".join(map(str, g.pids())), self.cfg.node, self.cfg.lease_ttl_s)
            self.session.close(revoke=not leave)
        self.ports.close()
