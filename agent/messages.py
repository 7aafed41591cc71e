"""The agent's side of the worker channel (lazarus.agent.channel, lazarus.trainer.session): who
may use it, what the agent tells its ranks (a checkpoint request, a snapshot kept), and what it
does with their messages: step and progress reports into the node status and the hang
detector, commits fenced on the round and claimed for the daemon, failures reported.

A message of a round other than the one the node's ranks run is dropped: a stale worker's
report must not count in the current round. That round is the one they were launched in,
which a replica round that carries them on (docs/replicas.md) does not change. Checkpoint
commits are fenced in etcd itself.
The ranks run the job's code: every field is bounded and every kind of message that becomes
an etcd write has a budget per round (lazarus.agent.msglimits).
The agent owns the state; the handlers run on the channel's threads, under its lock where
they touch what a pass reads.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING

from lazarus.agent import msglimits
from lazarus.agent.adopt import AdoptedRank
from lazarus.agent.assignment import readable
from lazarus.agent.channel import descends_from
from lazarus.core import etcd as E
from lazarus.core.contract import ABSENT, CORRUPT, RESTORE_KINDS, UNREADABLE, Progress
from lazarus.core.records import CheckpointRecord, EventRecord, RoundRecord

if TYPE_CHECKING:
    from lazarus.agent.service import Agent

log = logging.getLogger("lazarus.agent")

# Spikes kept in the node status: enough for the daemon's window, bounded for etcd.
MAX_SPIKES = 32


# -- to the ranks ----------------------------------------------------------------------------
def pass_on_checkpoint_request(agent: Agent, kv: E.KV | None) -> None:
    """A new request id (the daemon's or an operator's) goes to every local rank once."""
    req = kv.value if kv is not None else b""
    if agent._checkpoint_request is None:
        agent._checkpoint_request = req  # requests older than this agent are not ours
    elif req != agent._checkpoint_request:
        agent._checkpoint_request = req
        agent.channel.broadcast({"type": "checkpoint_requested"})
        log.info("checkpoint requested: passed on to the workers")


def snapshot_kept(agent: Agent, rank: int, step: int, durable: bool) -> None:
    # To every local rank: each takes the ones of its own rank (lazarus.trainer.session).
    agent.channel.broadcast({"type": "snapshot_kept", "rank": rank, "step": step,
                             "durable": durable})


# -- from the ranks --------------------------------------------------------------------------
def on_message(agent: Agent, msg: dict) -> dict | None:
    """The channel's callback: a dict returned is the reply to the rank."""
    kind = msg.get("type")
    handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
    return handler(agent, msg) if handler is not None else None


def admits(agent: Agent, pid: int) -> bool:
    """Who may use the worker channel: the agent's process and whatever it started (its
    workers, parked or running, and what they start), and the ranks it adopted from the
    agent before it, with whatever they start."""
    g = agent.workers.group
    roots = {os.getpid()}
    if g is not None:
        roots.update(p.pid for p in list(g.procs.values())
                     if isinstance(p, AdoptedRank) and p.returncode is None)
    return descends_from(pid, roots)


def _group_round(agent: Agent) -> int | None:
    """The round the group's ranks were launched in: the one their messages carry."""
    g = agent.workers.group
    return g.rank_round if g is not None else None


def _local_ranks(agent: Agent) -> list[int]:
    g = agent.workers.group
    return list(g.ranks.values()) if g is not None else []


def _step(agent: Agent, msg: dict) -> None:
    with agent._lock:
        if msg.get("round") == _group_round(agent):
            st = agent.report.step
            first = st["step"] == 0
            st["step"] = max(st["step"], int(msg.get("step", 0)))
            if first and st["step"] > 0:
                # The round's first step makes the node "running" (nodestatus.workers_state):
                # written at once, not at the loop's next tick, since the daemon's RUNNING and
                # its recovery figure wait for it.
                agent.wake.set()
            spike = msg.get("spike")
            # Every rank skips the same steps (the guard's verdict is global): global rank 0's
            # node alone reports them, so a skip is one status write in the whole cluster,
            # not one per node (4,096 at once at the real size).
            if isinstance(spike, dict) and msg.get("rank") == 0:
                agent.report.spikes.append({"step": int(msg.get("step", 0)),
                                            "window": msglimits.cursors(spike.get("window")),
                                            "loss": msglimits.number(spike.get("loss")),
                                            "reason": msglimits.text(spike.get("reason"), 200)})
                del agent.report.spikes[:-MAX_SPIKES]
                agent.wake.set()
            if agent.cfg.monitors:
                _observe_step(agent, msg)
            if msg.get("rank") == min(_local_ranks(agent), default=0):
                window = msglimits.cursors(msg.get("window"))
                if window is not None:
                    st["window"] = window
                st["loss"] = float(msg.get("loss", 0.0))
                dt = float(msg.get("step_time_s", 0.0))
                # Only a loss may be NaN in a node status (records.Reading): the daemon
                # computes with times and refuses a status where one is not.
                dt = dt if math.isfinite(dt) else 0.0
                rate = float(msg.get("tokens", 0)) / dt if dt > 0 else 0.0
                st["step_time_s"] = dt
                st["tokens_per_s"] = rate if math.isfinite(rate) else 0.0


def _observe_step(agent: Agent, msg: dict) -> None:
    """Feed the throughput tracker (lock held). Tokens in a report are the global batch's; a
    rank's share is its 1/world of them."""
    try:
        compute = msg.get("compute_s")
        agent.throughput.observe(
            rank=int(msg["rank"]), step=int(msg["step"]), node=agent.cfg.node,
            step_time_s=float(msg.get("step_time_s", 0.0)),
            tokens=int(msg.get("tokens", 0)) // max(1, agent.report.world_size),
            compute_s=float(compute) if compute is not None else None)
    except (KeyError, TypeError, ValueError):
        pass  # a malformed report costs its sample, nothing else


def _progress(agent: Agent, msg: dict) -> None:
    try:
        progress = Progress.from_message(msg)
    except (KeyError, TypeError, ValueError):
        return
    with agent._lock:
        if msg.get("round") == _group_round(agent):
            agent.hangs.observe(int(msg.get("rank", -1)), progress)
            track_long_phase(agent)


def track_long_phase(agent: Agent) -> None:
    """Note when a local rank enters or leaves a checkpoint/eval (lock held); a change is
    published at once, because the daemon holds other nodes' hang reports meanwhile. Called
    on each progress message and each pass of the agent: a change held back by its budget is
    made on a later pass, though no message follows."""
    since = agent.hangs.long_phase_since()
    entered = since is not None and not agent.report.long_phase["since"]
    left = since is None and agent.report.long_phase["since"]
    # each change is a status write at once: a rank flipping its phase must not drive them
    if (entered or left) and not _within(agent, "phase", "long-phase changes"):
        return
    if entered:
        # with the allowance its ranks get there: the daemon holds peers' reports no longer
        # than that (lazarus.daemon.decide._peer_in_long_phase)
        agent.report.long_phase = {"since": time.time() - (time.monotonic() - since),
                                   "until": agent.report.long_phase["until"],
                                   "allowance_s": round(agent.hangs.timeout_s(), 1)}
        agent.wake.set()
    elif left:
        agent.report.long_phase = {"since": 0.0, "until": time.time()}
        agent.wake.set()


def _within(agent: Agent, kind: str, what: str) -> bool:
    """Whether this round's budget of `kind` (lazarus.agent.msglimits) has room (lock held);
    the first message over it is said in the log, the rest only counted."""
    allowed, first_drop = agent.report.limits.take(kind)
    if first_drop:
        burst, per_s = msglimits.LIMITS[kind]
        log.warning("round %s: this node's ranks send more %s than the agent passes on "
                    "(%d at once, then %.2g a second); the rest are dropped and counted",
                    _group_round(agent), what, burst, per_s)
    return allowed


def _joined(agent: Agent, msg: dict) -> None:
    with agent._lock:
        if msg.get("round") == _group_round(agent):
            agent.report.joined.add(msg.get("rank"))
    agent.wake.set()


def _may_commit(agent: Agent, msg: dict) -> dict:
    return {"type": "may_commit", "ok": fenced_write(agent, msg.get("round"))}


def _fenced_on(agent: Agent, round_: object) -> object:
    """The round a rank's commit is fenced on: the one its message carries, or, for ranks a
    replica round carried on (docs/replicas.md), the round their group was carried into --
    their messages keep their launch round, which is never the current one again."""
    with agent._lock:
        g = agent.workers.group
        if g is not None and round_ == g.rank_round and g.round != g.rank_round:
            return g.round
    return round_


def fenced_write(agent: Agent, round_: object, ops: tuple = ()) -> bool:
    """Write `ops` if `round_` (a message's) is still the run's round, or the round this
    node's replica was carried into: a linearizable compare in etcd, not our possibly stale
    view. False also while etcd is away."""
    if not isinstance(round_, int):
        return False
    try:
        if _write_if_round(agent, _fenced_on(agent, round_), ops):
            return True
        # Another replica's round may have started since our last pass (the group is
        # relabelled only then): a commit landing in that gap is still this replica's.
        carried = _carried_into(agent, round_)
        return carried is not None and _write_if_round(agent, carried, ops)
    except E.EtcdUnavailable:
        return False


def _write_if_round(agent: Agent, round_: object, ops: tuple) -> bool:
    return agent.etcd.txn([E.value_is(agent.keys.round, str(round_).encode())], list(ops))


def _carried_into(agent: Agent, launch: int) -> int | None:
    """The run's round as etcd has it, if its record carries this node's replica on from
    `launch`, the round this node's ranks were launched in; else None (a whole-world round
    carries nobody, so its stale workers stay fenced out)."""
    _, known = agent.assignments.current
    if known is None or known.replicas <= 1:
        return None  # not a replica job: a refused message costs etcd no reads
    with agent._lock:
        g = agent.workers.group
        if g is None or g.rank_round != launch:
            return None
    kv = agent.etcd.get(agent.keys.round)
    try:
        current = int(kv.value) if kv is not None else None
    except ValueError:
        return None
    kv = agent.etcd.get(agent.keys.round_key(current)) if current is not None else None
    rec = readable({}, RoundRecord, kv) if kv is not None else None
    return rec.round if rec is not None and rec.carries(agent.cfg.node, launch) else None


def _committed(agent: Agent, msg: dict) -> None:
    """Claim the commit (ckptclaims/): the leader checks the claim and makes it the checkpoint
    record, which agents' etcd role may not write (docs/security.md)."""
    try:
        rec = CheckpointRecord(step=int(msg["step"]), path=str(msg["path"]),
                               round=int(msg["round"]), job_id=agent.report.job_id,
                               committed_at=time.time())
    except (KeyError, TypeError, ValueError):
        log.warning("dropping malformed checkpoint report %s", msglimits.text(msg, 200))
        return
    if len(rec.path) > msglimits.MAX_PATH:
        log.warning("dropping the checkpoint report of step %d: its path is longer than %d "
                    "characters", rec.step, msglimits.MAX_PATH)
        return
    with agent._lock:
        if not _within(agent, "claim", "checkpoint commits"):
            return
    if fenced_write(agent, rec.round, (E.put_op(agent.keys.claim_key(rec.step), rec.to_json()),)):
        log.info("checkpoint step %d committed (round %d); claimed for the daemon to record",
                 rec.step, rec.round)
    else:
        log.warning("checkpoint step %d of round %d not registered: round is stale or etcd "
                    "is away", rec.step, rec.round)


def _checkpoint_failed(agent: Agent, msg: dict) -> None:
    """A save the storage refused (rank 0 tells, once per save): an event for the operator,
    fenced on the round like a commit, so a stale worker's report is dropped. Training goes
    on; what to do about the disk is the host monitor's and the daemon's."""
    try:
        step, round_ = int(msg["step"]), int(msg["round"])
        error = msglimits.text(msg["error"])
    except (KeyError, TypeError, ValueError):
        log.warning("dropping malformed checkpoint failure report %s", msglimits.text(msg, 200))
        return
    with agent._lock:
        if not _within(agent, "event", "checkpoint failure reports"):
            return
    text = (f"checkpoint step {step} not written: {error}; training goes on, the last "
            "committed checkpoint stays the restore point")
    log.warning("%s", text)
    ev = EventRecord(time=time.time(), kind="checkpoint_failed", message=text, round=round_,
                     fields={"step": step, "error": error, "reported_by": agent.cfg.node})
    # refused, or etcd away: the worker log and ours still say it
    fenced_write(agent, round_, (E.put_op(agent.keys.event_key(agent.cfg.node), ev.to_json()),))


def _snapshot(agent: Agent, msg: dict) -> None:
    if agent.tier0 is not None and msg.get("round") == _group_round(agent):
        agent.tier0.taken(agent.report.job_id, msg)


def _restore_failed(agent: Agent, msg: dict) -> None:
    with agent._lock:
        if msg.get("round") == _group_round(agent):
            _note_restore_failure(agent, msg)
    agent.wake.set()


def _note_restore_failure(agent: Agent, msg: dict) -> None:
    """Keep the node's most telling finding (lock held): its ranks share its view of the
    storage, but each hashed other files, and what condemns the checkpoint comes first."""
    kind = msg.get("kind")
    if kind not in RESTORE_KINDS:
        return
    weight = {CORRUPT: 3, UNREADABLE: 2, ABSENT: 1, "": 0}
    found = agent.report.restore_failed
    if found and weight[kind] <= weight[found["kind"]]:
        return
    agent.report.restore_failed = {"checkpoint": str(msg.get("checkpoint", ""))[:500],
                                   "kind": kind, "reason": str(msg.get("reason", ""))[:500]}


def _survivor(agent: Agent, msg: dict) -> None:
    """A rank of this node lost a peer, not itself, and waits for the next round in its
    process (lazarus.trainer.inplace): the round's end keeps it (lazarus.agent.decide)."""
    with agent._lock:
        g = agent.workers.group
        if g is None or msg.get("round") != g.rank_round:
            return
        for local_rank, proc in g.procs.items():
            if proc.pid == msg.get("pid") and g.ranks[local_rank] == msg.get("rank"):
                g.survivors.add(local_rank)
                log.info("round %d rank %d (pid %d) survived a lost peer at step %s and waits "
                         "for the next round", g.round, g.ranks[local_rank], proc.pid,
                         msg.get("step"))
    agent.wake.set()


def _refused(agent: Agent, msg: dict) -> None:
    with agent._lock:
        if msg.get("round") == _group_round(agent):
            agent.report.refused = str(msg.get("reason", ""))[:500]
    agent.wake.set()


_HANDLERS = {"step": _step, "progress": _progress, "joined": _joined,
             "may_commit": _may_commit, "committed": _committed,
             "checkpoint_failed": _checkpoint_failed, "snapshot": _snapshot,
             "restore_failed": _restore_failed, "refused": _refused, "survivor": _survivor}
