"""`lazarus agent`: one per node. Registers the node under a lease, hosts the rendezvous store,
keeps warm parked workers, runs the workers of the round it is assigned, and reports.

The agent is level-triggered like the daemon: each pass reads run/status and the current
round record and converges its workers on them (start the round's workers, or kill workers of
a round that is over). It never decides membership; it obeys the round record.

While etcd is unreachable the workers keep training: nothing here kills a worker because etcd
is away. Checkpoint commits need etcd (they are fenced on the round), so none commit then.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
import zlib
from pathlib import Path

from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core import logs
from lazarus.core.errors import UserError
from lazarus.core.records import (RENDEZVOUS, ROLE_ACTIVE, ROLE_SPARE, RUNNING, W_FAILED, W_IDLE,
                             W_RUNNING, W_STARTING, W_SUCCEEDED, CheckpointRecord, EventRecord,
                             Keys, NodeRecord, NodeStatus, OUTPUT_TAIL_BYTES, RecordError,
                             RoundRecord, RunStatus)
from lazarus.agent.adopt import (AdoptedRank, Left, LeftRank, NodeLock, adopt, forget,
                                 record_path, start_time)
from lazarus.agent.channel import Channel, descends_from
from lazarus.agent.hang import LONG_CAP_S, LONG_FLOOR_S, HangConfig, HangDetector
from lazarus.core.contract import (ABSENT, AGENT_GRACE_ENV, CORRUPT, PROGRESS_ENV,
                                   RESTORE_KINDS, STACK_CAPTURE_S, STACKS_ENV, UNREADABLE,
                                   SCRIPT_PG_TIMEOUT_ENV, Progress, WorkerAssignment,
                                   round_port_key, without_secrets)
from lazarus.core.privatedir import private_dir
from lazarus.core.throughput import ThroughputTracker
from lazarus.agent.health import NodeHealth
from lazarus.agent.netif import collective_env
from lazarus.agent import collective_check as coll
from lazarus.agent import preflight as pre
from lazarus.agent import frozen
from lazarus.agent.stacks import (ask_flight_records, capture, collect_flight_recorder,
                                  FLIGHT_ENTRIES, describe_flight, dumpable, flight_recorder_env,
                                  flight_records, request_flight_recorder_dumps)
from lazarus.agent.workers import RANK_LOG_BYTES, Workers, rank_log, tail
from lazarus.agent.tier0_agent import Tier0, Tier0Options, add_tier0_args, tier0_options

log = logging.getLogger("lazarus.agent")

# Node status is written at once on a change of state (workers, health, a hang, a long phase,
# a spike), else at most once a period while the step moves, with the throughput summary: the
# write budget (docs/architecture.md, "Write budget") is 0.1 writes/s per node in steady
# state. Liveness is the lease alone; nothing reads the age of a status as a sign of life.
STATUS_PERIOD_S = 15.0
# The agent converges its workers on its assignment (run/status and the round record) this
# often, and at once when something wakes it ...
RECONCILE_S = 0.5
# ... but reads the assignment from etcd only when its watches on run/ and commands/ deliver
# news, and else this often, in case a watch lost something: a read per reconcile would be
# 16,000 reads/s on etcd at 4,096 nodes (docs/architecture.md, "Write budget").
REREAD_S = 10.0
# A status period is stretched by up to this fraction at random each time (see _init_state).
PERIOD_JITTER = 0.2
# Spikes kept in the node status: enough for the daemon's window, bounded for etcd.
MAX_SPIKES = 32
# How often the ranks' log files are held to their size (lazarus.agent.workers.bound_logs): a
# rank writes at most a few MB a second.
LOG_CHECK_S = 5.0
# An idle node repeats its preflight checks this often (docs/operations.md, "Preflight").
PREFLIGHT_EVERY_S = 600.0
# Ranks whose agent is gone wait one lease TTL and this much for the next one before they
# stop (lazarus.agent.adopt): an agent back within the TTL still needs a moment to listen.
ORPHAN_MARGIN_S = 5.0


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
                 flight_entries: int = FLIGHT_ENTRIES, rank_log_bytes: int = RANK_LOG_BYTES):
        """`allowed_roots`: where jobs may have this node's ranks write (lazarus.core.jobpaths);
        None: anywhere (`lazarus agent` always passes a list: its --allowed-root, else its
        workdir). `flight_entries`: the collectives torch's flight recorder keeps per process
        group of a rank; 0 turns it off."""
        if role not in (ROLE_ACTIVE, ROLE_SPARE):
            raise UserError(f"--role must be {ROLE_ACTIVE} or {ROLE_SPARE}, not {role!r}")
        if not node or "/" in node:
            raise UserError(f"--node {node!r}: a node id is a non-empty name without '/'")
        self._init_state(etcd, keys, node=node, nproc=nproc, role=role, host=host,
                         lease_ttl_s=lease_ttl_s, status_period_s=status_period_s,
                         workdir=workdir, monitors=monitors,
                         hangs=HangDetector(hang_config or HangConfig()))
        self.allowed_roots = [str(r) for r in allowed_roots or ()]
        private_dir(workdir, "--workdir")
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
        env = {**without_secrets(os.environ), "LAZARUS_AGENT_SOCKET": sock, "LAZARUS_NODE": node,
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
                               notes_dir=self.stacks_dir, park=park, log_bytes=rank_log_bytes)
        if left is not None:
            self._adopt(left)
        # Listening before the store's slow import: adopted ranks reconnect at once.
        self.channel = Channel(sock, on_message=self._on_message, admit=self._admits)
        if tier0 is not None:
            self.tier0 = Tier0(node=node, host=host, options=tier0, lookup=self._node_record,
                               on_kept=self._snapshot_kept)
        import torch.distributed as dist  # the agent hosts a round's store when it is first

        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        if preflight_every_s is not None and monitors:
            self.preflight = pre.Runner(every_s=preflight_every_s, run=self._preflight_checks,
                                        on_done=self.wake.set)
            # idle nodes' collective tests against this one (lazarus.agent.collective_check)
            self.peer_tests = coll.PeerTests(self.store, host=host, port=self.store.port)

    def _admits(self, pid: int) -> bool:
        """Who may use the worker channel: this process and whatever it started (its workers,
        parked or running, and what they start), and the ranks it adopted from the agent
        before it, with whatever they start."""
        g = self.workers.group
        roots = {os.getpid()}
        if g is not None:
            roots.update(p.pid for p in list(g.procs.values())
                         if isinstance(p, AdoptedRank) and p.returncode is None)
        return descends_from(pid, roots)

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
        self.session: E.Session | None = None
        self.wake = threading.Event()
        self._resume_lease: int | None = None
        self._registered = False            # the node record names this process
        self._lock = threading.Lock()       # guards the step fields the channel updates
        self._step = {"step": 0, "loss": 0.0, "step_time_s": 0.0, "tokens_per_s": 0.0}
        self._spikes: list[dict] = []       # skipped steps of the current round (newest last)
        self._job_id = ""                   # job of the round our workers run
        self.hangs = hangs
        self.throughput = ThroughputTracker()
        self._world_size = 1
        self._long_phase = {"since": 0.0, "until": 0.0}  # see NodeStatus.long_phase
        self._hang: dict | None = None      # this round's hang report, once made
        self._refused = ""                  # why a rank refused this round's job
        self._restore_failed: dict = {}     # what this round's ranks found wrong in its restore
        self._joined: set = set()           # ranks that made their process group (collwatch)
        self._tail: tuple[int, str] = (0, "")  # (round, its failed rank's last output)
        self._next_log_check = 0.0
        self._round_stores: dict = {}       # round -> the store this node hosts for it
        self._checkpoint_dir: str | None = None
        self._adopted_round: int | None = None  # until its old node status is read back
        self._checkpoint_request: bytes | None = None
        self._unreadable: dict[str, int] = {}  # key -> mod revision of the value named
        self._published_state: tuple | None = None
        self._published_step = -1
        self._published_at = 0.0
        # Each status write waits a period stretched by up to this fraction, at random: a
        # round starts every agent's period at once, and without it they stay in step and
        # write in bursts of the whole fleet.
        self._period_jitter = random.Random(node)
        self._next_period_s = status_period_s
        self._watches: list[E.Watch] = []
        self.outage = E.OutageLog(etcd, log, "workers keep training")
        # The assignment (run/status, the round record) as last read, and news of a change:
        # read again on news from the watches, else every REREAD_S (see reconcile()).
        self._assignment: tuple[RunStatus | None, RoundRecord | None] = (None, None)
        self._news = 1                      # counts watch deliveries ...
        self._news_read = 0                 # ... up to the one the assignment was read after
        self._read_at = -REREAD_S
        self.reads = 0                      # assignment reads so far (the fleet counts them)
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
        self._published_state = None  # the new lease has no status key yet
        self._save_left()  # it names the lease
        log.info("registered %s (%s, %d ranks, store port %d)", self.node, self.role,
                 self.nproc, self.store.port)

    # -- the worker channel ------------------------------------------------------------------
    def _snapshot_kept(self, rank: int, step: int, durable: bool) -> None:
        # To every local rank: each takes the ones of its own rank (lazarus.trainer.session).
        self.channel.broadcast({"type": "snapshot_kept", "rank": rank, "step": step,
                                "durable": durable})

    def _on_message(self, msg: dict) -> dict | None:
        kind = msg.get("type")
        if kind == "step":
            with self._lock:
                if msg.get("round") == self._group_round():
                    st = self._step
                    st["step"] = max(st["step"], int(msg.get("step", 0)))
                    spike = msg.get("spike")
                    # Every rank skips the same steps (the guard's verdict is global): global
                    # rank 0's node alone reports them, so a skip is one status write in the
                    # whole cluster, not one per node (4,096 at once at the real size).
                    if isinstance(spike, dict) and msg.get("rank") == 0:
                        self._spikes.append({"step": int(msg.get("step", 0)),
                                             "window": spike.get("window"),
                                             "loss": spike.get("loss"),
                                             "reason": spike.get("reason")})
                        del self._spikes[:-MAX_SPIKES]
                        self.wake.set()
                    if self.monitors:
                        self._observe_step(msg)
                    if msg.get("rank") == min(self._local_ranks(), default=0):
                        if isinstance(msg.get("window"), list):
                            st["window"] = msg["window"]
                        st["loss"] = float(msg.get("loss", 0.0))
                        dt = float(msg.get("step_time_s", 0.0))
                        # Only a loss may be NaN in a node status (records.Reading): the
                        # daemon computes with times and refuses a status where one is not.
                        dt = dt if math.isfinite(dt) else 0.0
                        rate = float(msg.get("tokens", 0)) / dt if dt > 0 else 0.0
                        st["step_time_s"] = dt
                        st["tokens_per_s"] = rate if math.isfinite(rate) else 0.0
            return None
        if kind == "progress":
            try:
                progress = Progress.from_message(msg)
            except (KeyError, TypeError, ValueError):
                return None
            with self._lock:
                if msg.get("round") == self._group_round():
                    self.hangs.observe(int(msg.get("rank", -1)), progress)
                    self._track_long_phase()
            return None
        if kind == "joined":
            with self._lock:
                if msg.get("round") == self._group_round():
                    self._joined.add(msg.get("rank"))
            self.wake.set()
            return None
        if kind == "may_commit":
            return {"type": "may_commit", "ok": self._round_is_current(msg.get("round"))}
        if kind == "committed":
            self._register_checkpoint(msg)
            return None
        if kind == "checkpoint_failed":
            self._report_checkpoint_failure(msg)
            return None
        if kind == "snapshot":
            if self.tier0 is not None and msg.get("round") == self._group_round():
                self.tier0.taken(self._job_id, msg)
            return None
        if kind == "restore_failed":
            with self._lock:
                if msg.get("round") == self._group_round():
                    self._note_restore_failure(msg)
            self.wake.set()
            return None
        if kind == "refused":
            with self._lock:
                if msg.get("round") == self._group_round():
                    self._refused = str(msg.get("reason", ""))[:500]
            self.wake.set()
            return None
        return None

    def _note_restore_failure(self, msg: dict) -> None:
        """Keep the node's most telling finding (lock held): its ranks share its view of the
        storage, but each hashed other files, and what condemns the checkpoint comes first."""
        kind = msg.get("kind")
        if kind not in RESTORE_KINDS:
            return
        weight = {CORRUPT: 3, UNREADABLE: 2, ABSENT: 1, "": 0}
        if self._restore_failed and weight[kind] <= weight[self._restore_failed["kind"]]:
            return
        self._restore_failed = {"checkpoint": str(msg.get("checkpoint", ""))[:500],
                                "kind": kind, "reason": str(msg.get("reason", ""))[:500]}

    def _group_round(self) -> int | None:
        g = self.workers.group
        return g.round if g is not None else None

    def _observe_step(self, msg: dict) -> None:
        """Feed the throughput tracker (lock held). Tokens in a report are the global batch's;
        a rank's share is its 1/world of them."""
        try:
            compute = msg.get("compute_s")
            self.throughput.observe(
                rank=int(msg["rank"]), step=int(msg["step"]), node=self.node,
                step_time_s=float(msg.get("step_time_s", 0.0)),
                tokens=int(msg.get("tokens", 0)) // max(1, self._world_size),
                compute_s=float(compute) if compute is not None else None)
        except (KeyError, TypeError, ValueError):
            pass  # a malformed report costs its sample, nothing else

    def _track_long_phase(self) -> None:
        """Note when a local rank enters or leaves a checkpoint/eval (lock held); a change is
        published at once, because the daemon holds other nodes' hang reports meanwhile."""
        since = self.hangs.long_phase_since()
        if since is not None and not self._long_phase["since"]:
            # with the allowance its ranks get there: the daemon holds peers' reports no
            # longer than that (lazarus.daemon.decide._peer_in_long_phase)
            self._long_phase = {"since": time.time() - (time.monotonic() - since),
                                "until": self._long_phase["until"],
                                "allowance_s": round(self.hangs.timeout_s(), 1)}
            self.wake.set()
        elif since is None and self._long_phase["since"]:
            self._long_phase = {"since": 0.0, "until": time.time()}
            self.wake.set()

    def _local_ranks(self) -> list[int]:
        g = self.workers.group
        return list(g.ranks.values()) if g is not None else []

    def _node_record(self, node: str) -> NodeRecord | None:
        """A node's registration as etcd has it now (where its agent takes tier-0 copies)."""
        kv = self.etcd.get(self.keys.node_key(node))
        return self._readable(NodeRecord, kv) if kv is not None else None

    def _round_is_current(self, round_: object) -> bool:
        """Fencing: a linearizable compare in etcd, not our possibly stale view."""
        if not isinstance(round_, int):
            return False
        try:
            return self.etcd.txn([E.value_is(self.keys.round, str(round_).encode())])
        except E.EtcdUnavailable:
            return False

    def _register_checkpoint(self, msg: dict) -> None:
        """Claim the commit (ckptclaims/): the leader checks the claim and makes it the
        checkpoint record, which agents' etcd role may not write (docs/security.md)."""
        try:
            rec = CheckpointRecord(step=int(msg["step"]), path=str(msg["path"]),
                                   round=int(msg["round"]), job_id=self._job_id,
                                   committed_at=time.time())
        except (KeyError, TypeError, ValueError):
            log.warning("dropping malformed checkpoint report %r", msg)
            return
        try:
            ok = self.etcd.txn([E.value_is(self.keys.round, str(rec.round).encode())],
                               [E.put_op(self.keys.claim_key(rec.step), rec.to_json())])
        except E.EtcdUnavailable:
            ok = False
        if ok:
            log.info("checkpoint step %d committed (round %d); claimed for the daemon to record",
                     rec.step, rec.round)
        else:
            log.warning("checkpoint step %d of round %d not registered: round is stale or "
                        "etcd is away", rec.step, rec.round)

    def _report_checkpoint_failure(self, msg: dict) -> None:
        """A save the storage refused (rank 0 tells, once per save): an event for the
        operator, fenced on the round like a commit, so a stale worker's report is dropped.
        Training goes on; what to do about the disk is the host monitor's and the daemon's."""
        try:
            step, round_, error = int(msg["step"]), int(msg["round"]), str(msg["error"])[:500]
        except (KeyError, TypeError, ValueError):
            log.warning("dropping malformed checkpoint failure report %r", msg)
            return
        text = (f"checkpoint step {step} not written: {error}; training goes on, the last "
                "committed checkpoint stays the restore point")
        log.warning("%s", text)
        ev = EventRecord(time=time.time(), kind="checkpoint_failed", message=text, round=round_,
                         fields={"step": step, "error": error, "reported_by": self.node})
        try:
            self.etcd.txn([E.value_is(self.keys.round, str(round_).encode())],
                          [E.put_op(self.keys.event_key(self.node), ev.to_json())])
        except E.EtcdUnavailable:
            pass  # the worker log and ours still say it

    # -- reconcile ---------------------------------------------------------------------------
    def _read_assignment(self) -> tuple[RunStatus | None, RoundRecord | None]:
        snap = self.etcd.snapshot([self.keys.status, self.keys.round,
                                   self.keys.checkpoint_request])
        self._pass_on_checkpoint_request(snap.kvs.get(self.keys.checkpoint_request))
        status = rec = None
        kv = snap.kvs.get(self.keys.status)
        if kv is not None:
            status = self._readable(RunStatus, kv)
            if status is None:
                return None, None
        if status is not None and status.round:
            kv = self.etcd.get(self.keys.round_key(status.round))
            if kv is not None:
                rec = self._readable(RoundRecord, kv)
        return status, rec

    def _readable(self, cls, kv: E.KV):
        """The record in `kv`, or None: an unreadable value is named once (per write of it),
        not at every read."""
        try:
            rec = cls.from_json(kv.value, kv.key)
        except RecordError as e:
            if self._unreadable.get(kv.key) != kv.mod_revision:
                self._unreadable[kv.key] = kv.mod_revision
                log.warning("ignoring %s", e)
            return None
        self._unreadable.pop(kv.key, None)
        return rec

    def _pass_on_checkpoint_request(self, kv: E.KV | None) -> None:
        """A new request id (the daemon's or an operator's) goes to every local rank once."""
        req = kv.value if kv is not None else b""
        if self._checkpoint_request is None:
            self._checkpoint_request = req  # requests older than this agent are not ours
        elif req != self._checkpoint_request:
            self._checkpoint_request = req
            self.channel.broadcast({"type": "checkpoint_requested"})
            log.info("checkpoint requested: passed on to the workers")

    def _on_news(self, _events: object = None) -> None:
        """A watch on run/ or commands/ delivered (or resynced): read the assignment again."""
        self._news += 1
        self.wake.set()

    def assignment(self, now: float) -> tuple[RunStatus | None, RoundRecord | None]:
        """The assignment, read again when there is news of it or it is REREAD_S old. An
        event that arrives during the read is news for the next pass, never lost."""
        if self._news != self._news_read or now - self._read_at >= REREAD_S:
            news = self._news
            self._assignment = self._read_assignment()
            self._news_read, self._read_at = news, now
            self.reads += 1
        return self._assignment

    def reconcile(self, now: float | None = None) -> None:
        self.register()
        status, rec = self.assignment(time.monotonic() if now is None else now)
        mine = (status is not None and rec is not None and status.state in (RENDEZVOUS, RUNNING)
                and rec.round == status.round and self.node in rec.members)
        g = self.workers.group
        if g is not None:
            newer = status is not None and status.round != g.round
            over = status is None or status.state not in (RENDEZVOUS, RUNNING)
            if newer or (over and g.alive):
                log.info("stopping round %d workers (%s)", g.round,
                         f"round {status.round} is current" if newer else
                         f"run is {status.state if status else 'gone'}")
                self.workers.stop()
                self._save_left()
        if self.tier0 is not None and rec is not None and status is not None \
                and rec.round == status.round:
            self.tier0.round_seen(rec)
        if mine and (self.workers.group is None or self.workers.group.round != rec.round):
            self._launch(rec)
        # Refill at once, even while a round starts: the next fault may come any second, and
        # a parked worker still importing torch then is no better than a cold start.
        self.workers.refill()

    def _host_round_store(self, rec: RoundRecord) -> None:
        """The first member hosts a store of the round's own (torch's env:// rendezvous
        prefixes no key: a store shared across rounds hands a restarted rank the dead round's
        entries) and publishes its port in this agent's store, where every rank looks."""
        import torch.distributed as dist

        self._round_stores = {r: s for r, s in self._round_stores.items() if r >= rec.round}
        if rec.members[0] != self.node or rec.round in self._round_stores:
            return
        store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
        self._round_stores[rec.round] = store
        self.store.set(round_port_key(rec.round), str(store.port))

    def _launch(self, rec: RoundRecord) -> None:
        ranks = rec.ranks_of(self.node)
        snapshots = (self.tier0.prepare(rec, ranks) if self.tier0 is not None
                     else dict.fromkeys(ranks))
        self._host_round_store(rec)
        self.workers.prune_logs(rec.round)
        assignments = {
            local: WorkerAssignment(rank=rank, world_size=rec.world_size, local_rank=local,
                                    round=rec.round, store_host=rec.store_host,
                                    store_port=rec.store_port, train=rec.train,
                                    restore=rec.restore, report_socket=self.channel.path,
                                    job_id=rec.job_id, snapshot=snapshots[rank],
                                    restore_step=rec.restore_step,
                                    snapshot_dir=str(self.tier0.store.incoming)
                                    if self.tier0 is not None else None,
                                    allowed_roots=self.allowed_roots,
                                    command=list(rec.command), env=dict(rec.env), cwd=rec.cwd,
                                    log_path=str(rank_log(self.workers.log_dir, rec.round,
                                                          rank)),
                                    group_rank=rec.members.index(self.node),
                                    group_world_size=len(rec.members),
                                    local_world_size=rec.nproc_per_node,
                                    restart_count=rec.restarts,
                                    max_restarts=rec.max_restarts)
            for local, rank in enumerate(ranks)}
        with self._lock:
            self._step = {"step": 0, "loss": 0.0, "step_time_s": 0.0, "tokens_per_s": 0.0}
            self._spikes = []
            self.hangs.reset()
            self.throughput.reset()
            self._world_size = rec.world_size
            self._hang = None
            self._refused = ""
            self._restore_failed = {}
            self._long_phase = {"since": 0.0, "until": 0.0}
            self._joined = set()
        self._job_id = rec.job_id
        self._checkpoint_dir = rec.checkpoint_dir
        self.health.watch_checkpoint_dir(self._checkpoint_dir)
        self.workers.launch(rec.round, assignments)
        self._save_left()
        log.info("round %d: started ranks %s%s", rec.round, ranks,
                 f", restoring step {rec.restore_step}" + (" from memory (tier 0)" if rec.tier0
                                                           else "")
                 if rec.restore or rec.tier0 else "")

    def _check_hang(self, now: float) -> None:
        """A hang is reported with the stacks of every local rank taken before anything is
        killed; the daemon names the culprit across nodes and restarts. A report is withdrawn
        if the ranks move again: they were waiting for a peer on another node that was in a
        checkpoint or an eval, which that node's status says (the daemon waits with it)."""
        g = self.workers.group
        if g is None or not g.alive:
            return
        with self._lock:
            verdict = self.hangs.check(now)
        if self._hang is not None:
            if verdict is None:
                log.info("hang report of round %d withdrawn: the ranks moved again", g.round)
                self._hang = None
            return
        if verdict is None:
            return
        pids = g.pids()
        asked = dumpable(pids, self.stacks_dir)
        # asked first, read after the stacks: the ranks write both meanwhile
        flying = ask_flight_records(pids, self.stacks_dir)
        request_flight_recorder_dumps(self.stacks_dir, sorted(g.ranks.values()))  # NCCL's own
        before = frozen.samples(pids)
        deadline = time.monotonic() + STACK_CAPTURE_S
        dump = capture(pids, self.stacks_dir, timeout_s=STACK_CAPTURE_S)
        after = frozen.samples(pids)
        # Within the stacks' own deadline, never after: the daemon's wait for the other nodes'
        # reports is sized on it, and a stopped rank (the culprit) answers neither.
        flights = flight_records(flying, self.stacks_dir,
                                 timeout_s=max(0.0, deadline - time.monotonic()))
        stuck = frozen.frozen({g.ranks[lr]: p.pid for lr, p in g.procs.items()
                               if lr in g.ranks}, before, after, dump, asked)
        if stuck:
            verdict = dataclasses.replace(
                verdict, culprits=tuple(sorted(stuck)), frozen=stuck,
                reason=f"{verdict.reason.partition(': ')[0]}: " + "; ".join(
                    f"rank {r} is frozen ({why})" for r, why in sorted(stuck.items())))
        saved = self.workdir / "hangs" / f"round{g.round}-{self.node}.txt"
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text("".join(
            f"=== rank {g.ranks.get(lr)} pid {p.pid} ===\n"
            f"{_flight_line(flights.get(p.pid), p.pid in flying)}"
            f"{dump.get(p.pid, _silent(p.pid, after, stuck.get(g.ranks.get(lr))))}\n"
            for lr, p in sorted(g.procs.items())))
        for lr, p in g.procs.items():
            if p.pid in flights:  # torch's own JSON beside it, for its fr_trace tool and people
                saved.with_name(f"{saved.stem}-rank{g.ranks.get(lr)}.flight.json").write_bytes(
                    flights[p.pid])
        nccl = {r: path for r, path in collect_flight_recorder(self.stacks_dir).items()
                if r in g.ranks.values()}
        if nccl:
            with open(saved, "a", encoding="utf-8") as f:
                f.write("=== NCCL's flight recorder dumps (pickles: read them with "
                        "python -m torch.distributed.flight_recorder.fr_trace) ===\n" + "".join(
                            f"rank {r}: {path}\n" for r, path in sorted(nccl.items())))
        self._hang = {**verdict.to_dict(), "stacks": str(saved), "at": time.time()}
        log.warning("hang in round %d: %s; stacks in %s", g.round, verdict.reason, saved)

    # -- status ------------------------------------------------------------------------------
    def _workers_state(self, step: int) -> str:
        g = self.workers.group
        if g is None:
            return W_IDLE
        if g.failed:
            return W_FAILED
        if g.succeeded:
            return W_SUCCEEDED
        # "running" once a step was reported: a round is joined when training really goes.
        # A script that reports no steps (level 0): once each of its ranks made its process
        # group (lazarus.trainer.collwatch).
        with self._lock:
            joined = bool(g.ranks) and set(g.ranks.values()) <= self._joined
        return W_RUNNING if step > 0 or joined else W_STARTING

    def status_state(self) -> tuple:
        """What a status write is due for at once when it changes; cheap, asked every pass
        (the whole status, with its throughput summary, is built only to be written)."""
        g = self.workers.group
        with self._lock:
            step, spikes = self._step["step"], len(self._spikes)
            long_phase = bool(self._long_phase.get("since"))
            refused = bool(self._refused)
            restore_failed = self._restore_failed.get("kind")
        health = self.health.poll() if self.monitors else {}
        checked = self.preflight.result if self.preflight is not None else {}
        return (self._workers_state(step), g.round if g else 0,
                g.failed_rank() if g else None, spikes, health.get("state"),
                self._hang is not None, long_phase, refused, checked.get("at"),
                restore_failed)

    def node_status(self) -> NodeStatus:
        g = self.workers.group
        with self._lock:
            st = dict(self._step)
            spikes = list(self._spikes)
            throughput = self.throughput.summary()
            long_phase = dict(self._long_phase)
            refused = self._refused
            restore_failed = dict(self._restore_failed)
        return NodeStatus(
            node=self.node, round=g.round if g else 0, workers=self._workers_state(st["step"]),
            exit_codes={str(k): v for k, v in g.exit_codes.items()} if g else {},
            failed_rank=g.failed_rank() if g else None, step=st["step"], loss=st["loss"],
            step_time_s=st["step_time_s"], tokens_per_s=st["tokens_per_s"],
            pids=g.pids() if g else [], parked=len(self.workers.parked),
            updated_at=time.time(), fault_at=g.fault_at if g else 0.0, spikes=spikes,
            window=st.get("window") or [],
            health=self.health.poll() if self.monitors else {}, hang=self._hang,
            throughput=throughput, long_phase=long_phase, refused=refused,
            preflight=dict(self.preflight.result) if self.preflight is not None else {},
            tier0=self.tier0.holdings(self._job_id, self._world_size)
            if self.tier0 is not None else {},
            restore_failed=restore_failed, output_tail=self._output_tail(g))

    def _output_tail(self, g) -> str:
        """The failed rank's last lines, read once per failed round."""
        if g is None or g.first_failure is None:
            return ""
        if self._tail[0] != g.round:
            rank = g.ranks[g.first_failure]
            self._tail = (g.round, tail(rank_log(self.workers.log_dir, g.round, rank),
                                        OUTPUT_TAIL_BYTES))
        return self._tail[1]

    def publish(self, *, force: bool = False) -> bool:
        """Write node status on a change of state at once, else at most once a (jittered)
        period while the step moves. True when it wrote."""
        state = self.status_state()
        now = time.time()
        if not force and state == self._published_state and (
                self._step["step"] == self._published_step
                or now - self._published_at < self._next_period_s):
            return False
        status = self.node_status()
        assert self.session is not None
        try:
            self.etcd.put(self.keys.nodestatus_key(self.node), status.to_json(),
                          lease=self.session.lease)
        except E.LeaseLost:
            self.session.mark_lost()  # register() starts a new session on the next pass
            return False
        self._published_state, self._published_step, self._published_at = state, status.step, now
        self._next_period_s = self.status_period_s * (
            1 + PERIOD_JITTER * self._period_jitter.random())
        return True

    # -- main loop ---------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.workers.refill()
        rev = 0
        while not stop.is_set() and not rev:
            try:
                self.register()
                self._resume_status()
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

    def _preflight_checks(self) -> list[pre.Check]:
        """The checks, in the preflight thread: storage and a checkpoint round trip in the
        job's checkpoint dir (the newest round's, once one was read), the GPU monitor's
        verdicts, this host's clock against etcd's leader, and a collective -- with one
        member of the round when the node is not in it (the path a promotion would use),
        else over the node's own address."""
        _, rec = self._assignment
        ckpt = rec.checkpoint_dir if rec is not None else self._checkpoint_dir
        peer = self._test_peer(rec)
        config = pre.PreflightConfig(workdir=self.workdir,
                                     checkpoint_dir=Path(ckpt) if ckpt else None,
                                     host=self.host, expected_gpus=self.nproc,
                                     pair=(peer.node, peer.host, peer.store_port) if peer
                                     else None)
        gpu = self.health.gpu
        checks = pre.run_checks(config, etcd=self.etcd,
                                gpu_verdicts=lambda: (list(gpu.verdicts), gpu.backend.name))
        if peer is not None and not checks[-1].ok and self._test_peer(rec) != peer:
            # The peer left (its lease ran out while the test waited for it): no verdict on
            # this node, which a recovery may want now.
            checks[-1] = dataclasses.replace(checks[-1], ok=True, skipped=True, reason=(
                f"skipped: {peer.node} left during the test ({checks[-1].reason})"))
        return checks

    def _test_peer(self, rec: RoundRecord | None) -> NodeRecord | None:
        """The member of `rec` this node tests its collective path with, when it is not one
        itself: picked by this node's name, so that the spares of a large run spread their
        tests over its members."""
        if rec is None or not rec.members or self.node in rec.members:
            return None
        peer = rec.members[zlib.crc32(self.node.encode()) % len(rec.members)]
        try:
            kv = self.etcd.get(self.keys.node_key(peer))
            return NodeRecord.from_json(kv.value, kv.key) if kv is not None else None
        except (E.EtcdUnavailable, RecordError):
            return None

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

    # -- ranks that outlive this agent (lazarus.agent.adopt) ---------------------------------
    def _save_left(self) -> None:
        """Write down the running round's ranks for a next agent of this node; forget them
        once the round is stopped. On each launch, stop and new lease: rare writes."""
        g = self.workers.group
        if g is None or self.session is None:
            forget(self._left_path)
            return
        ranks = [LeftRank(local_rank=lr, rank=g.ranks[lr], pid=p.pid,
                          started=getattr(p, "started", None) or start_time(p.pid) or 0.0)
                 for lr, p in sorted(g.procs.items())]
        Left(node=self.node, round=g.round, job_id=self._job_id, world_size=self._world_size,
             lease=self.session.lease, channel=self.channel.path,
             checkpoint_dir=self._checkpoint_dir, agent_pid=os.getpid(),
             ranks=ranks).save(self._left_path)

    def _adopt(self, left: Left) -> None:
        procs = adopt(left, self.stacks_dir)
        self.workers.adopt(left.round, procs, {r.local_rank: r.rank for r in left.ranks})
        self._job_id, self._world_size = left.job_id, left.world_size
        self._checkpoint_dir = left.checkpoint_dir
        self.health.watch_checkpoint_dir(left.checkpoint_dir)
        self._adopted_round = left.round
        running = [p.pid for p in procs.values() if p.poll() is None]
        log.info("adopted round %d ranks %s left by agent pid %d: %s", left.round,
                 [r.rank for r in left.ranks], left.agent_pid,
                 f"pids {' '.join(map(str, running))} running" if running else
                 "all of them exited meanwhile")

    def _resume_status(self) -> None:
        """Carry on the adopted round's node status where the previous agent left it (the
        step, loss and data window until the ranks' next report), not from step 0."""
        if self._adopted_round is None:
            return
        kv = self.etcd.get(self.keys.nodestatus_key(self.node))
        self._adopted_round, round_ = None, self._adopted_round
        try:
            old = NodeStatus.from_json(kv.value) if kv is not None else None
        except RecordError:
            old = None
        if old is None or old.round != round_:
            return
        with self._lock:
            self._step = {"step": old.step, "loss": old.loss, "step_time_s": old.step_time_s,
                          "tokens_per_s": old.tokens_per_s, "window": old.window}


def _flight_line(record: bytes | None, asked: bool) -> str:
    """The stacks file's line on a rank's collectives (lazarus.agent.stacks.describe_flight)."""
    if record is not None:
        return f"collectives (flight recorder): {describe_flight(record)}\n"
    return "collectives (flight recorder): no answer\n" if asked else ""


def _silent(pid: int, after: dict, why: str | None) -> str:
    """What the stacks file says of a rank that gave no stack."""
    if why:
        return f"(no stack: the process is frozen -- {why})"
    state = after.get(pid)
    return (f"(no stack: the process did not answer; state {state.state or 'gone'})"
            if state is not None else "(no stack: the process did not answer)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lazarus agent", description=__doc__.splitlines()[0])
    settings.add_etcd_args(p, lease_ttl=settings.LEASE_TTL_S, lease_help="node lease TTL in seconds")
    p.add_argument("--node", default=socket.gethostname(), help="node id (default: hostname)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (worker processes) on this node")
    p.add_argument("--role", default=ROLE_ACTIVE, help="active or spare")
    p.add_argument("--host", default="127.0.0.1", help="address peers reach this node at")
    p.add_argument("--workdir", default=os.environ.get("LAZARUS_WORKDIR", "/tmp/lazarus"),
                   help="the worker socket, worker logs, stacks and hang reports; created "
                        "mode 0700 if missing, refused if others may enter it "
                        "(default: $LAZARUS_WORKDIR, else /tmp/lazarus)")
    p.add_argument("--no-park", action="store_true", help="do not keep warm parked workers")
    p.add_argument("--gpu-backend", default="auto", choices=("auto", "nvml", "sim"),
                   help="GPU health source: NVML, the simulated backend, or auto (NVML when "
                        "it finds a GPU)")
    p.add_argument("--hang-k", type=float, default=3.0,
                   help="a rank hangs after k x the median step time without progress")
    p.add_argument("--hang-floor", type=float, default=10.0,
                   help="... and never before this many seconds")
    p.add_argument("--first-step-timeout", type=float, default=HangConfig().first_step_timeout_s,
                   help="a rank hangs after this many seconds without progress before two of "
                        "its steps were timed; a script that reports no steps (level 0, "
                        "docs/adopting.md) always has this allowance between its collectives "
                        "(default %(default)s)")
    p.add_argument("--rank-log-mb", type=float, default=RANK_LOG_BYTES / (1 << 20),
                   help="a rank's log file (WORKDIR/logs/NODE/round-R/rank-N.log) is rotated "
                        "past this size, one old copy kept (default %(default)s)")
    p.add_argument("--long-phase-floor", type=float, default=LONG_FLOOR_S,
                   help="a checkpoint or eval phase hangs after %(default)s s or 4x its "
                        "median duration so far, whichever is longer (at most 600 s)")
    p.add_argument("--flight-entries", type=int, default=FLIGHT_ENTRIES,
                   help="collectives torch's flight recorder keeps per process group of each "
                        "rank, read for a hang's report (default %(default)s); 0 turns it off")
    p.add_argument("--gpu-faults", type=Path, default=None,
                   help="fault script of the simulated GPU backend (default: "
                        "WORKDIR/NODE.gpu-faults.json; `lazarus chaos gpu-xid` writes it)")
    p.add_argument("--min-free-mb", type=float, default=None,
                   help="host monitor: the checkpoint dir fails below this much free space "
                        "(default 1024)")
    p.add_argument("--low-free-mb", type=float, default=None,
                   help="... and is degraded below this much (default 10240)")
    p.add_argument("--monitors", choices=("on", "off"), default="on",
                   help="GPU, host, hang and throughput monitors and the workers' progress "
                        "reports; 'off' exists to measure what they cost")
    p.add_argument("--status-period", type=float, default=STATUS_PERIOD_S,
                   help="seconds between node status writes while only the step moves (a "
                        "change of state is written at once) (default %(default)s)")
    p.add_argument("--preflight-every", type=float, default=PREFLIGHT_EVERY_S,
                   help="seconds between the preflight checks of a node that runs no ranks "
                        "(`lazarus preflight`); 0: only at start (default %(default)s)")
    p.add_argument("--preflight", choices=("on", "off"), default="on",
                   help="'off': no preflight checks, and the daemon does not wait for them")
    add_tier0_args(p)
    p.add_argument("--allowed-root", action="append", default=None, metavar="DIR",
                   help="a directory jobs may have this node's ranks write in (their "
                        "checkpoint dir, their metrics); repeat for more. A job with a path "
                        "outside them fails at its start with the reason (default: the workdir)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logs.setup(args.log_level, f"agent[{args.node}]")
    if args.preflight_every < 0:
        raise UserError("--preflight-every must be 0 (only at start) or a number of seconds")
    if not args.status_period > 0:
        raise UserError("--status-period must be positive")
    if args.nproc < 1:
        raise UserError("--nproc must be at least 1")
    settings.check_lease_ttl(args.lease_ttl)
    if args.flight_entries < 0:
        raise UserError("--flight-entries must be 0 (no flight recorder) or a number of "
                        f"collectives, not {args.flight_entries}")
    if not args.first_step_timeout > 0 or not args.rank_log_mb > 0:
        raise UserError("--first-step-timeout and --rank-log-mb must be positive")
    if args.hang_k <= 1 or args.hang_floor <= 0:
        raise UserError("--hang-k must be above 1 and --hang-floor positive")
    if not 0 < args.long_phase_floor <= LONG_CAP_S:
        raise UserError(f"--long-phase-floor must be above 0 and at most {LONG_CAP_S:.0f} s, "
                        f"got {args.long_phase_floor}")
    host_limits = _host_limits(args)
    etcd = E.Etcd(args.etcd, auth=settings.etcd_auth(args))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent = Agent(etcd, Keys(args.root), node=args.node, nproc=args.nproc, role=args.role,
                  workdir=Path(args.workdir), host=args.host, lease_ttl_s=args.lease_ttl,
                  park=not args.no_park, gpu_backend=args.gpu_backend,
                  gpu_faults=args.gpu_faults,
                  hang_config=HangConfig(k=args.hang_k, floor_s=args.hang_floor,
                                         long_floor_s=args.long_phase_floor,
                                         first_step_timeout_s=args.first_step_timeout),
                  rank_log_bytes=int(args.rank_log_mb * (1 << 20)),
                  host_limits=host_limits, monitors=args.monitors == "on",
                  status_period_s=args.status_period,
                  preflight_every_s=args.preflight_every if args.preflight == "on" else None,
                  tier0=tier0_options(args, Path(args.workdir)),
                  # absolute: the ranks resolve them, whatever their working directory
                  allowed_roots=[os.path.abspath(r) for r in args.allowed_root or [args.workdir]],
                  flight_entries=args.flight_entries)
    try:
        agent.run(stop)
    finally:
        etcd.close()
    # Not through the interpreter's exit: a preflight stopped midway leaves torch's threads (a
    # gloo group's, a store's) unjoined, and a C++ thread destroyed unjoined aborts the process
    # ("terminate called without an active exception": exit -6 after a clean stop, where
    # systemd and the tests expect 0). Everything the agent owns is settled by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _host_limits(args: argparse.Namespace) -> dict:
    limits = {}
    for flag, name in (("min_free_mb", "min_free_bytes"), ("low_free_mb", "low_free_bytes")):
        value = getattr(args, flag)
        if value is not None:
            if value < 0:
                raise UserError(f"--{flag.replace('_', '-')} must not be negative")
            limits[name] = int(value * (1 << 20))
    return limits
