"""What the API reports from one view (daemon.view): run health, nodes, events, checkpoints.

Pure functions of the view and the clock, so every daemon (leader or standby) answers the
same way, and tests can feed them records directly. Garbage records are skipped, as in
daemon.view.
"""

from __future__ import annotations

import json

from google.protobuf import struct_pb2

from lazarus.core import etcd as E
from lazarus.daemon import preflight, stragglers
from lazarus.daemon.decide import health_of
from lazarus.daemon.history import History
from lazarus.daemon.view import ClusterView, prefixes  # noqa: F401 (what the API reads)
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.core.records import (ROLE_SPARE, RUNNING, TERMINAL, W_IDLE, W_RUNNING, W_SUCCEEDED,
                                  CheckpointRecord, EventRecord, RecordError, RunStatus,
                                  load_json, number)

# Node.state values beyond the worker states an agent reports. Outside the run a node is
# what it registered as: a spare waits to be promoted; an active node has simply no work
# (the run has its nodes, or there is no run), and "spare" would say it is one.
SPARE, CORDONED, LOST, STARTING = "spare", "cordoned", "lost", "starting"
IDLE = W_IDLE


def with_history(history: History | None, view: ClusterView) -> list[EventRecord]:
    """The run's events, oldest first: those retention moved to the daemon's history
    (lazarus.daemon.history) and the view's (etcd's copy when both hold a key)."""
    if history is None:
        return [ev for _, ev in view.events]
    merged = {**history.events(), **{kv.key: (kv, ev) for kv, ev in view.events}}
    return [merged[key][1] for key in sorted(merged)]


def goodput(evs: list[EventRecord], job_id: str, now: float) -> tuple[float, float, float]:
    """(goodput, wall_s, productive_s) of job `job_id` from its events.

    Wall time runs from the job's acceptance to its end (or now). Productive time is time in
    RUNNING with no open incident; a fault ends it at the moment the fault happened, not when
    it was detected. Steps re-done after a restore count as productive (an upper bound).
    """
    start = run_from = None
    productive, end, incident = 0.0, now, False
    for ev in evs:
        if ev.kind == "job_accepted":
            if ev.fields.get("id") == job_id:
                start, run_from, productive, end, incident = ev.time, None, 0.0, now, False
            continue
        if start is None:
            continue
        if ev.kind == "fault_detected":
            incident = True
            if run_from is not None:
                fault_at = number(ev.fields.get("fault_at"))
                if fault_at is None:
                    fault_at = ev.time
                productive += min(max(fault_at, run_from), ev.time) - run_from
                run_from = None
        elif ev.kind == "recovered":
            incident = False
        producing = ev.state == RUNNING and not incident
        if producing and run_from is None:
            run_from = ev.time
        elif not producing and run_from is not None:
            productive += ev.time - run_from
            run_from = None
        if ev.state in TERMINAL:
            end = ev.time
            break
    if start is None:
        return -1.0, 0.0, 0.0
    if run_from is not None:
        productive += max(0.0, end - run_from)
    wall = max(0.0, end - start)
    return (productive / wall if wall > 0 else 0.0), wall, productive


def node_state(node: str, view: ClusterView, members: set[str]) -> str:
    """`members`: the run's members (a set: this is asked of every node)."""
    st = view.status
    if node in view.cordoned:
        return CORDONED
    if node not in view.nodes:
        return LOST
    if st is None or node not in members:
        return SPARE if view.nodes[node].role == ROLE_SPARE else IDLE
    ns = view.node_status.get(node)
    if ns is not None and ns.round == st.round:
        return ns.workers
    return STARTING


def _drains(view: ClusterView) -> list[str]:
    return sorted(view.drains)


def checkpoint_message(rec: CheckpointRecord) -> pb.Checkpoint:
    return pb.Checkpoint(step=rec.step, path=rec.path, round=rec.round, job_id=rec.job_id,
                         committed_at=rec.committed_at, good=rec.good)


def event_message(kv: E.KV, ev: EventRecord) -> pb.Event:
    fields = struct_pb2.Struct()
    # Struct holds JSON values only; what came from etcd is JSON already.
    fields.update(json.loads(json.dumps(ev.fields)))
    return pb.Event(revision=kv.mod_revision, time=ev.time, kind=ev.kind, message=ev.message,
                    round=ev.round, state=ev.state, fields=fields)


def _leader(view: ClusterView) -> pb.Leader | None:
    kv = view.leader
    if kv is None:
        return None
    try:
        doc = load_json(kv.value, kv.key)
    except RecordError:
        doc = None
    if not isinstance(doc, dict):
        return pb.Leader(id="(unreadable leader record)")
    pid = doc.get("pid")
    return pb.Leader(id=_text(doc.get("id", "")), host=_text(doc.get("host", "")),
                     api=_text(doc.get("api", "")),
                     pid=pid if isinstance(pid, int) and not isinstance(pid, bool)
                     and pid >= 0 else 0)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)[:200]


def run_health(view: ClusterView, *, now: float, served_by: str,
               all_events: list[EventRecord] | None = None) -> pb.RunHealth:
    """`all_events`: the run's events, oldest first, when there are more than etcd's (the
    daemon's history of pruned ones, lazarus.daemon.history); by default the view's."""
    h = pb.RunHealth(revision=view.revision, served_by=served_by,
                     paused=view.pause_revision is not None, draining=_drains(view))
    leader = _leader(view)
    if leader is not None:
        h.leader.CopyFrom(leader)
        h.served_by_leader = leader.id == served_by
    st: RunStatus | None = view.status
    if st is not None:
        h.job_id, h.state, h.reason, h.since = st.job_id, st.state, st.reason, st.since
        h.round, h.restarts = st.round, st.restarts
        h.members.extend(st.members)
        if view.job is not None and view.job.id == st.job_id:
            h.job_name = view.job.name
            steps = view.job.train.get("steps", 0)
            h.total_steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else 0
        current = [view.node_status[n] for n in st.members
                   if n in view.node_status and view.node_status[n].round == st.round]
        if current:
            h.step = max(ns.step for ns in current)
            # Loss and throughput as rank 0 sees them (tokens are counted for the whole batch).
            first = next((ns for ns in current if ns.node == st.members[0]), current[0])
            h.loss, h.tokens_per_s, h.step_time_s = first.loss, first.tokens_per_s, first.step_time_s
        _script_progress(h, view, current, now)
        _replicas(h, view)
        if st.incident is not None:
            inc = st.incident  # its keys typed (records.Incident)
            h.incident.CopyFrom(pb.Incident(
                kind=inc["kind"], culprit=inc["culprit"], fault_at=inc["fault_at"],
                detected_at=inc["detected_at"], round=inc["round"], reason=st.reason))
        if all_events is None:
            all_events = [ev for _, ev in view.events]
        h.goodput, h.wall_time_s, h.productive_time_s = goodput(all_events, st.job_id, now)
        mine = [c for c in view.checkpoints if c.job_id == st.job_id]
        if mine:
            h.last_checkpoint.CopyFrom(checkpoint_message(mine[-1]))
        good = [c for c in mine if c.good]
        if good:
            h.last_good_checkpoint.CopyFrom(checkpoint_message(good[-1]))
    else:
        h.goodput = -1.0
    members = set(st.members) if st is not None else set()
    for node in _node_names(view):
        state = node_state(node, view, members)
        h.nodes_by_state[state] = h.nodes_by_state[state] + 1
    return h


def _replicas(h: pb.RunHealth, view: ClusterView) -> None:
    """The current round's replica groups (docs/replicas.md): a replica restarted by the open
    incident heals until that incident closes, when its ranks step again."""
    rnd, st = view.round, view.status
    if rnd is None or st is None or rnd.round != st.round or rnd.replicas < 2:
        return
    healing = st.incident.get("replicas") if isinstance(st.incident, dict) else None
    healing = healing if isinstance(healing, list) else []  # an agent's garbage: none heals
    for r in range(rnd.replicas):
        h.replicas.add(replica=r, members=rnd.replica_members(r),
                       since_round=rnd.replica_rounds[r],
                       state="healing" if r in healing else "training")


def _script_progress(h: pb.RunHealth, view: ClusterView, current: list, now: float) -> None:
    """What is known of a round whose ranks report no steps (level 0: docs/adopting.md):
    its ranks joined, the collectives they all issued (the least node's), their rate (the
    slowest node's, from its two newest statuses: daemon.view) and the time since the
    newest."""
    job = view.job
    h.steps_unknown = not (job is not None and job.id == h.job_id and job.builtin
                           or any(ns.step > 0 for ns in current))
    h.collectives, h.last_collective_age_s = -1, -1.0
    rnd = view.round
    if rnd is not None and view.status is not None and rnd.round == view.status.round:
        h.world_size = rnd.world_size
        h.ranks_joined = rnd.nproc_per_node * sum(ns.workers in (W_RUNNING, W_SUCCEEDED)
                                                  for ns in current)
    reported = [ns for ns in current if ns.collectives >= 0]
    if not reported:
        return
    h.collectives = min(ns.collectives for ns in reported)
    rates = [view.collective_rate[ns.node] for ns in reported if ns.node in view.collective_rate]
    h.collectives_per_s = min(rates, default=0.0)
    newest = max(ns.collective_at for ns in reported)
    h.last_collective_age_s = max(0.0, now - newest) if newest > 0 else -1.0


def _node_names(view: ClusterView) -> list[str]:
    lost = [n for n in view.status.members if n not in view.nodes] if view.status else []
    return sorted(set(view.nodes) | set(lost))


def list_nodes(view: ClusterView, *, now: float) -> list[pb.Node]:
    drains = set(view.drains)
    slow = _stragglers(view)
    members = set(view.status.members) if view.status is not None else set()
    positions: dict[str, int] = {}  # node -> its place in the round (its ranks follow)
    for i, name in enumerate(view.round.members if view.round is not None else []):
        positions.setdefault(name, i)
    out = []
    for name in _node_names(view):
        try:
            out.append(_node(name, view, drains, now, slow, members, positions))
        except (ValueError, TypeError):  # a number out of the wire's range: a garbage record
            continue
    return out


def _stragglers(view: ClusterView) -> dict[str, str]:
    """Node -> why it is a straggler now (the throughput monitor's verdict, judged across
    nodes as the controller judges it)."""
    st, job = view.status, view.job
    if st is None or job is None or st.state != RUNNING or job.id != st.job_id:
        return {}
    try:
        found = stragglers.find(view, job, st)
    except ValueError:  # an accepted job whose [policy] no longer parses: no verdict
        return {}
    return {s.node: s.reason for s in sorted(found, key=lambda s: -s.ratio)}


def _node(name: str, view: ClusterView, drains: set[str], now: float, slow: dict[str, str],
          members: set[str], positions: dict[str, int]) -> pb.Node:
    node = pb.Node(node=name, state=node_state(name, view, members),
                   cordoned=name in view.cordoned,
                   cordon_reason=view.cordon_reason.get(name, "") if name in view.cordoned else "",
                   draining=name in drains, registered=name in view.nodes,
                   last_report_age_s=-1.0)
    rec = view.nodes.get(name)
    if rec is not None:
        node.host, node.role, node.nproc, node.pid = rec.host, rec.role, rec.nproc, rec.pid
        node.lease_ttl_s = rec.lease_ttl_s
        node.registered_for_s = max(0.0, now - rec.started_at) if rec.started_at else 0.0
    if name in positions:
        per = view.round.nproc_per_node
        node.ranks.extend(range(positions[name] * per, (positions[name] + 1) * per))
    ns = view.node_status.get(name)
    if ns is not None:
        node.round, node.step, node.loss = ns.round, ns.step, ns.loss
        node.step_time_s, node.tokens_per_s, node.parked = ns.step_time_s, ns.tokens_per_s, ns.parked
        node.step_rate = 1.0 / ns.step_time_s if ns.step_time_s > 0 else 0.0
        if ns.updated_at:
            node.last_report_age_s = max(0.0, now - ns.updated_at)
        for monitor in ("gpu", "host"):
            state, reasons = health_of(view, name, monitor)
            if monitor in (ns.health if isinstance(ns.health, dict) else {}):
                node.health.add(monitor=monitor, state=state, reasons=reasons)
        if ns.throughput:
            node.health.add(monitor="throughput", state="degraded" if name in slow else "healthy",
                            reasons=[slow[name]] if name in slow else [])
        _tier0(node, ns.tier0)
        if isinstance(ns.hang, dict) and ns.round == (view.status.round if view.status else -1):
            node.health.add(monitor="hang", state="failed",
                            reasons=[str(ns.hang.get("reason", ""))[:500]])
    if rec is not None:
        node.gpu_backend = rec.gpu_backend
    checked, why, cost = preflight.verdict(view, name)
    if checked:
        # healthy / failed as the monitors say it; "running" until the first checks finish
        node.health.add(monitor="preflight",
                        state={"passed": "healthy", "failed": "failed"}.get(checked, checked),
                        reasons=[why or ("checks under way" if checked == "running"
                                         else f"{checked} in {cost:.1f} s")])
    return node


def _tier0(node: pb.Node, held) -> None:
    """The node's tier-0 report (NodeStatus.tier0), where it has the shape agents write."""
    if not isinstance(held, dict):
        return
    steps = [s for v in (held.get("ranks") or {}).values() if isinstance(v, list) for s in v
             if isinstance(s, int) and not isinstance(s, bool)] \
        if isinstance(held.get("ranks"), dict) else []
    for field, value in (("tier0_bytes", held.get("bytes")), ("tier0_limit_bytes", held.get("limit")),
                         ("tier0_step", max(steps, default=0))):
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
            setattr(node, field, value)


def list_checkpoints(view: ClusterView, *, limit: int) -> list[pb.Checkpoint]:
    out = []
    for rec in view.checkpoints[-limit:] if limit else view.checkpoints:
        try:
            out.append(checkpoint_message(rec))
        except (ValueError, TypeError):  # a number out of the wire's range: a garbage record
            continue
    return out
