"""A replica round: a fault in one replica of a replica job restarts only that replica, as pure
policy (docs/replicas.md).

A job with `[job] failure_unit = "replica"` trains `replicas` replica groups, each a world of
its own (consecutive equal blocks of the round's members). When a fault's decision would end
the whole round (decide._check_faults: RECOVERING), `respond` turns it into a new round in the
same pass in which only the broken replicas' ranks start: the other replicas' ranks go on
untouched from the round they were launched in (the record's `replica_rounds`, which the
agents read to carry them on), and the restarted ones heal from them through the quorum. A
node that is gone is replaced in place by a free spare, so every replica keeps its ranks.

It stays a whole-world recovery (the fault's decision as it is) when every replica is broken
or still healing from an earlier fault (no live peer to heal from), when the first member is a culprit (its agent hosts the
store of every replica's world and the quorum's), when a gone node has no spare to take its
place (a replica does not shrink), and when the restarts are used up (decide._recovering
then fails the run, as for any fault).
"""

from __future__ import annotations

import dataclasses

from lazarus.core.jobspec import JobSpec
from lazarus.core.records import (MAX_ROUND, RECOVERING, RENDEZVOUS, SUCCEEDED, W_FAILED,
                                  W_SUCCEEDED, RoundRecord, RunStatus)
from lazarus.daemon import unkillable
from lazarus.daemon.actions import Decision, Emit, SetStatus, StartRound
from lazarus.daemon.rounds import free_spares, usable
from lazarus.daemon.view import ClusterView

# The faults a replica can be restarted for: each names the nodes whose ranks broke.
KINDS = frozenset({"worker_crash", "node_lost", "peer_lost", "gpu_failed", unkillable.KIND,
                   "hang"})
# Of those, the kinds whose culprit nodes cannot serve again (lost, or cordoned in the same
# pass): a spare takes each one's place.
GONE = frozenset({"node_lost", "gpu_failed", unkillable.KIND})


def respond(now: float, view: ClusterView, job: JobSpec, st: RunStatus, fault: Decision, *,
            early_limit: int) -> Decision | None:
    """The replica round that answers `fault` (the decision of a fault in the live round, RUNNING
    or RENDEZVOUS), or None: the fault's decision stands. `early_limit`: the rounds in a row
    that crash before they run after which decide._recovering fails the run (a replica that
    cannot start must not be restarted forever)."""
    rec = _live_record(view, job, st)
    if rec is None:
        return None
    sets = [a for a in fault.actions if isinstance(a, SetStatus)]
    if len(sets) != 1 or sets[0].status.state != RECOVERING:
        return None
    failed = sets[0].status
    incident = failed.incident if isinstance(failed.incident, dict) else {}
    kind = incident.get("kind")
    culprits = str(incident.get("culprit", "")).split(",")
    if kind not in KINDS or not all(c in rec.members for c in culprits):
        return None
    if (rec.members[0] in culprits or st.restarts >= job.max_restarts
            or failed.early_failures >= early_limit):
        return None
    # Every replica whose ranks failed restarts, a culprit's or not: ranks that exited cannot
    # be carried on.
    broken_nodes = set(culprits) | {n for n in rec.members if (s := view.node_status.get(n))
                                    is not None and s.round == st.round and s.workers == W_FAILED}
    broken = sorted({rec.replica_of(n) for n in broken_nodes})
    # A replica restarted by an earlier fault that has not stepped yet holds no state to heal
    # from: only the others are sources, and without one the world starts anew.
    sources = [r for r in range(rec.replicas)
               if r not in broken and r not in (healing(st, rec.replicas) or {})]
    if not sources:
        return None
    # A node cordoned meanwhile (by an operator) cannot take its replica's new ranks either.
    gone = [n for n in rec.members if kind in GONE and n in culprits
            or rec.replica_of(n) in broken and n in view.cordoned]
    spares = [n for n in free_spares(view, job, st) if n not in culprits]
    if len(spares) < len(gone):
        return None
    n = max(st.round, view.last_round) + 1
    if n >= MAX_ROUND:
        return None
    swap = dict(zip(gone, spares))
    record = _next_record(rec, n, swap, broken, restarts=st.restarts + 1, job=job)
    return _decision(now, fault, failed, record, rec.members, broken, sources, swap, kind)


def swap_said(job: JobSpec, spare: str) -> str:
    """How a drain will swap `spare` in, as its request says it."""
    if _replica_job(job):
        return f"swap in {spare}, its replica restarting to heal from a live one"
    return f"checkpoint, then swap in {spare}"


def move(now: float, view: ClusterView, job: JobSpec, st: RunStatus,
         nodes: list[str]) -> Decision | None:
    """A planned move of `nodes` out of a running replica job (a drain: the operator's, a
    degrading GPU's or host's, a straggler's swap): only their replicas restart, each moved
    node's place taken by an idle spare, and heal from a live replica while the others train
    on -- no checkpoint, no whole-world round, no restart counted. A decision to wait while
    an earlier replica round still heals (one incident at a time); None where a replica round
    cannot do it (the whole-world drain then, after a checkpoint): not a replica job, the
    first member moved (its agent hosts the quorum's store), no live replica left to heal
    from, or fewer idle spares than nodes moved (a replica does not shrink)."""
    rec = _live_record(view, job, st)
    if (rec is None or not nodes or not set(nodes) <= set(rec.members)
            or rec.members[0] in nodes):
        return None
    broken = sorted({rec.replica_of(n) for n in nodes})
    if healing(st, rec.replicas) is not None:
        return Decision([], f"drain {','.join(nodes)}: waiting for the replica(s) healing "
                            "to step first")
    sources = [r for r in range(rec.replicas) if r not in broken]
    spares = [n for n in usable(view, job) if n not in st.members]
    n = max(st.round, view.last_round) + 1
    if not sources or len(spares) < len(nodes) or n >= MAX_ROUND:
        return None
    swap = dict(zip(nodes, spares))
    record = _next_record(rec, n, swap, broken, restarts=st.restarts, job=job)
    # An incident like a fault's, so that the round is watched until the moved replicas step
    # (recovered, replica_joined), dated from this decision.
    moving = dataclasses.replace(st, incident={"kind": "drain", "culprit": ",".join(nodes),
                                               "fault_at": now, "detected_at": now,
                                               "round": st.round})
    return _decision(now, Decision([], ""), moving, record, rec.members, broken, sources,
                     swap, "drain", planned=True)


def _replica_job(job: JobSpec) -> bool:
    return job.failure_unit == "replica" and job.replicas > 1


def _live_record(view: ClusterView, job: JobSpec, st: RunStatus) -> RoundRecord | None:
    """The record of the live round of a replica job, or None: not one, or not read yet."""
    rec = view.round
    if (not _replica_job(job) or rec is None or rec.round != st.round
            or rec.replicas != job.replicas or rec.members != st.members):
        return None
    return rec


def _next_record(rec: RoundRecord, n: int, swap: dict[str, str], broken: list[int], *,
                 restarts: int, job: JobSpec) -> RoundRecord:
    """Round `n`: `broken` replicas start anew (a spare in each `swap`ped node's place), the
    others carried from the round their ranks were launched in."""
    return dataclasses.replace(
        rec, round=n, members=[swap.get(m, m) for m in rec.members],
        replica_rounds=[n if r in broken else rr for r, rr in enumerate(rec.replica_rounds)],
        restore=None, restore_step=0, tier0=None, restarts=restarts,
        max_restarts=job.max_restarts)


def _decision(now: float, fault: Decision, failed: RunStatus, record: RoundRecord,
              old: list[str], broken: list[int], sources: list[int], swap: dict[str, str],
              kind: str, *, planned: bool = False) -> Decision:
    n, replicas = record.round, record.replicas
    said = ", ".join(map(str, broken))
    head = "replica move" if planned else f"replica recovery {record.restarts}"
    why = (f"{head}: restart replica(s) {said}, the others go on"
           + (f", promote {', '.join(swap.values())} in place of {', '.join(swap)}"
              if swap else ""))
    msg = (f"round {n}: {len(record.members)} node(s) {', '.join(record.members)}, world "
           f"{record.world_size} ({replicas} replicas x dp {record.dp} x tp {record.tp}), "
           f"replica(s) {said} anew, healing from replica(s) {', '.join(map(str, sources))}"
           f" -- {why}")
    status = dataclasses.replace(
        failed, state=RENDEZVOUS, round=n, members=list(record.members), since=now,
        reason=why, restarts=record.restarts, restore=None, restore_step=0,
        incident={**failed.incident, "replicas": broken})
    events = []
    k = len(record.members) // replicas
    for r in broken:
        left = old[r * k:(r + 1) * k]
        events.append(Emit("replica_left", f"replica {r} ({', '.join(left)}) left: {kind}",
                           {"replica": r, "nodes": left, "reason": kind}))
    for r in broken:
        mine = record.replica_members(r)
        promoted = [m for m in mine if m in swap.values()]
        events.append(Emit(
            "replica_healing",
            f"replica {r} restarts in round {n} on {', '.join(mine)}"
            + (f" ({', '.join(promoted)} promoted)" if promoted else "")
            + f", healing from replica(s) {', '.join(map(str, sources))}",
            {"replica": r, "spares": promoted, "sources": sources}))
    kept = [a for a in fault.actions if not isinstance(a, SetStatus)]
    return Decision([*kept, StartRound(record), SetStatus(status), *events,
                     Emit("round_started", msg, {"members": list(record.members),
                                                 "restore_step": 0, "replicas": broken})], msg)


def healing(st: RunStatus, replicas: int) -> dict[int, list[str]] | None:
    """The replicas the incident of `st` restarted, each with its nodes (the round's members,
    `replicas` blocks of them), or None: the incident was no replica round's."""
    inc = st.incident
    said = inc.get("replicas") if isinstance(inc, dict) else None
    if not isinstance(said, list) or replicas < 2 or len(st.members) % replicas:
        return None
    k = len(st.members) // replicas
    return {r: st.members[r * k:(r + 1) * k] for r in said
            if isinstance(r, int) and not isinstance(r, bool) and 0 <= r < replicas} or None


def finished(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision | None:
    """The run is done when every replica that was not healing finished its steps: a replica
    still healing then has no peer left to heal from, and the model is the finished ones'.
    None while any of those trains on."""
    heal = healing(st, job.replicas)
    if heal is None:
        return None
    k = len(st.members) // job.replicas
    done = [r for r in range(job.replicas) if r not in heal
            and all((s := view.node_status.get(n)) is not None and s.round == st.round
                    and s.workers == W_SUCCEEDED for n in st.members[r * k:(r + 1) * k])]
    if not done or len(done) + len(heal) < job.replicas:
        return None
    said = ", ".join(map(str, sorted(heal)))
    reason = (f"all steps done by replica(s) {', '.join(map(str, done))} in round {st.round}; "
              f"replica(s) {said} were still healing and are stopped")
    status = dataclasses.replace(st, state=SUCCEEDED, since=now, incident=None, reason=reason)
    return Decision([SetStatus(status), Emit("succeeded", reason)], reason)
