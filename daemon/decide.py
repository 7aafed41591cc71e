"""The controller's policy: `decide(now, view) -> Decision(actions, reason)`. Pure.

Level-triggered: every call looks at the whole state and returns what would converge it, so
acting twice on the same view is harmless (the executor's compare on run/status makes the
second attempt a no-op) and a sequence of changes the loop never saw does not matter.
The clock is an argument; nothing here reads etcd, the clock or the environment.

Failure classes handled here (docs/architecture.md, "Failure classes"):
  worker crash    -> same members, new round, restore the last committed checkpoint
  node lost       -> evict, promote a spare (else shrink to >= min_nodes), new round
  rendezvous stuck-> members that did not join are treated as lost
  node back/idle  -> joins at the next checkpoint committed in the current round (grow)
  straggler       -> flagged; swapped out at a checkpoint when a spare is idle and it pays
  host failing    -> alerted, training goes on (hostalert); a node-local fault is swapped
                     out at a checkpoint when a spare is idle
  preflight failed-> the node is cordoned with the reason, whatever the run does (preflight)
  unkillable rank -> a rank SIGKILL cannot end (in the kernel on a dead mount): the node is
                     cordoned with the reason until an operator uncordons it, and replaced
                     like a lost node (unkillable)
  restore failed  -> the checkpoint condemned for what is wrong with it, or the node that
                     alone cannot read it cordoned (restorefail)
  commit claimed  -> checked and made the step's record, or refused, in any state (ckptcheck)
"""

from __future__ import annotations

import dataclasses

from lazarus.core import exitcodes
from lazarus.core import settings
from lazarus.core.contract import STACK_CAPTURE_S, HangVerdict
from lazarus.core.culprits import combine
from lazarus.core import jobspec
from lazarus.core.errors import UserError
from lazarus.core.jobspec import JobSpec
from lazarus.core.records import (FAILED, H_DEGRADED, H_FAILED, H_HEALTHY, PAUSED, PENDING, RECOVERING, RENDEZVOUS, RUNNING,
                             ROLE_ACTIVE, SUCCEEDED, TERMINAL,
                             W_FAILED, W_RUNNING, W_SUCCEEDED, RunStatus)
from lazarus.daemon import (ckptcheck, commands, hostalert, preflight, replicaround,
                            restorefail, spikes, stragglers, tier0, unkillable)
from lazarus.daemon.actions import (AcceptJob, Cordon, Decision, Emit, MarkCheckpoint, RejectJob,
                                    RequestDrain,
                                    SetStatus)
from lazarus.daemon.rounds import choose, free_spares, restore_point, start_round, usable
from lazarus.daemon.view import ClusterView


def decide(now: float, view: ClusterView) -> Decision:
    # Agents' claims of a commit first: the rest decides from the view with the adopted ones
    # among its records, so a recovery in this pass restores the newest checkpoint.
    claims, view = ckptcheck.adopt_claims(view)
    # A node holding a process SIGKILL cannot end is cordoned first, and the rest decides
    # with the cordon in its view, so no round chosen in this pass takes it; the live round's
    # members are replaced with their cordon (_check_faults), in one event.
    st = view.status
    live = set(st.members) if st is not None and st.state in (RENDEZVOUS, RUNNING) else set()
    stuck = unkillable.respond(view, skip=live)
    if stuck is not None:
        view = dataclasses.replace(view, cordoned=view.cordoned | {
            a.node for a in stuck.actions if isinstance(a, Cordon)})
    decision = _decide(now, view)
    # Whatever the run does, a node that failed its preflight is cordoned (and lifted when it
    # passes again) in the same transaction: it is never chosen meanwhile (rounds.usable).
    gate = preflight.respond(view)
    parts = [p for p in (claims, stuck, gate) if p is not None]
    if not parts:
        return decision
    actions = [a for p in (*parts, decision) for a in p.actions]
    return Decision(actions, "; ".join(p.reason for p in (*parts, decision)),
                    awaiting=() if actions else decision.awaiting)


def _decide(now: float, view: ClusterView) -> Decision:
    st = view.status
    sub = view.submitted
    if st is None and view.status_garbled:
        return _repair_status(now, view)
    if sub is not None and (st is None or sub.id != st.job_id):
        if st is not None and st.state not in TERMINAL:
            return Decision([], f"job {sub.id} waits: run {st.job_id} is {st.state}")
        try:
            jobspec.validate_sizes(sub, source=f"job {sub.name!r}")
        except UserError as e:
            return Decision([RejectJob(sub.id), Emit("job_rejected", str(e), {"id": sub.id})],
                            str(e))
        status = RunStatus(job_id=sub.id, state=PENDING, since=now,
                           reason=f"job {sub.name!r} ({sub.id}) accepted")
        return Decision([AcceptJob(sub), SetStatus(status),
                         Emit("job_accepted", status.reason, {"job": sub.name, "id": sub.id})],
                        status.reason)
    if st is None:
        return Decision([], "no job submitted (lazarus submit JOB.toml)")
    if st.state in TERMINAL:
        return Decision([], f"run {st.state}: {st.reason}")
    job = view.job
    if job is None or job.id != st.job_id:
        return Decision([], f"accepted job record of run {st.job_id} is missing or unreadable")
    return commands.immediate(now, view, st) or _HANDLERS[st.state](now, view, job, st)


def _lost(view: ClusterView, st: RunStatus) -> list[str]:
    return [n for n in st.members if n not in view.nodes]


def _failed(view: ClusterView, st: RunStatus) -> list[str]:
    return [n for n in st.members if (s := view.node_status.get(n)) is not None
            and s.round == st.round and s.workers == W_FAILED]


def _primary(view: ClusterView, node: str) -> bool:
    """A node whose workers failed on their own, not only because a peer went away."""
    return any(code != exitcodes.PEER_LOST for code in view.node_status[node].exit_codes.values())


def _peer_grace_s(view: ClusterView, st: RunStatus) -> float:
    """How long a peer-lost failure waits for its root cause to show: a dead node needs its
    lease TTL to be noticed, a crashed rank's agent reports within a second."""
    ttls = [view.nodes[n].lease_ttl_s for n in st.members if n in view.nodes]
    return max(ttls, default=settings.LEASE_TTL_S) + 1.0


def _repair_status(now: float, view: ClusterView) -> Decision:
    """run/status is unreadable (hand-edited, corrupted). The run is not lost: the round
    records say which job ran on which nodes, so rebuild the status and recover from there."""
    rec = view.latest_round
    if rec is None or view.job is None or view.job.id != rec.job_id:
        return Decision([], "run/status is unreadable and no round record tells which run it "
                            "was; fix or delete the key")
    reason = f"run/status was unreadable; rebuilt from round {rec.round}, recovering"
    status = RunStatus(job_id=rec.job_id, state=RECOVERING, round=rec.round,
                       members=list(rec.members), since=now, reason=reason,
                       incident={"kind": "status_repaired", "culprit": "run/status",
                                 "fault_at": now, "detected_at": now, "round": rec.round})
    return Decision([SetStatus(status), Emit("status_repaired", reason)], reason)


def _to_recovering(now: float, st: RunStatus, kind: str, culprits: list[str], reason: str,
                   fault_at: float, **event_fields) -> Decision:
    # A fault is in the past, and after the epoch: a clock ahead of ours or an agent's garbage
    # says otherwise, and run/status must stay a record we can read back.
    fault_at = min(max(fault_at, 0.0), now)
    incident = {"kind": kind, "culprit": ",".join(culprits), "fault_at": fault_at,
                "detected_at": now, "round": st.round}
    status = dataclasses.replace(st, state=RECOVERING, since=now, reason=reason,
                                 incident=incident)
    return Decision([SetStatus(status), Emit("fault_detected", reason,
                                             {**incident, **event_fields})], reason)


def _unkillable(now: float, view: ClusterView, st: RunStatus) -> Decision | None:
    """Members holding a process SIGKILL cannot end: cordoned (unless they are already) and
    replaced, as lost nodes are: the next round is chosen without them."""
    stuck = {n: e for n in st.members if (e := unkillable.stuck(view, n))}
    if not stuck:
        return None
    d = _to_recovering(now, st, unkillable.KIND, list(stuck),
                       f"{unkillable.cannot_serve(stuck)}, replaced", now,
                       processes=dict(list(stuck.items())[:unkillable.NODES_SAID]))
    return Decision([*(unkillable.cordon(n, e) for n, e in stuck.items()
                       if n not in view.cordoned), *d.actions], d.reason)


def health_of(view: ClusterView, node: str, monitor: str) -> tuple[str, list[str]]:
    """(state, reasons) a node's agent reports for one monitor; garbage reads as healthy."""
    ns = view.node_status.get(node)
    report = ns.health.get(monitor) if ns is not None and isinstance(ns.health, dict) else None
    if not isinstance(report, dict) or report.get("state") not in (H_DEGRADED, H_FAILED):
        return H_HEALTHY, []
    reasons = report.get("reasons")
    if not isinstance(reasons, list):  # the GPU monitor nests its reasons per GPU
        gpus = report.get("gpus") if isinstance(report.get("gpus"), list) else []
        reasons = [f"gpu{g.get('index')}: {r}" for g in gpus if isinstance(g, dict)
                   and isinstance(g.get("reasons"), list) and g.get("state") == report["state"]
                   for r in g["reasons"]]
    return report["state"], [_clip(str(r)) for r in reasons[:6]]


# What an agent reported goes into run/status and events at most this long: one huge value
# must not make the leader's transaction more than etcd takes (1.5 MiB by default), which
# would fail every pass that takes the same decision.
REPORTED_TEXT = 200


# Rounds in a row that crash the same way before they run, after which the run fails: a
# script that exits at its start fails in seconds, not after max_restarts rounds.
EARLY_FAILURES = 3
# Lines of a crashed rank's last output in the fault's message (the event has them all).
OUTPUT_LINES = 3


def _clip(text: str) -> str:
    return text if len(text) <= REPORTED_TEXT else text[:REPORTED_TEXT - 3] + "..."


# How long the first hang report of a round waits for the other members' reports (their
# ranks stall too), so that the culprit is named from every rank's position. The node of a
# stopped rank reports a whole stack capture after its detection, the others at once: the
# wait is that capture plus the skew between nodes' detections and status writes.
HANG_REPORT_WAIT_S = STACK_CAPTURE_S + 2.0


def _hang(now: float, view: ClusterView, st: RunStatus) -> Decision | None:
    reports: dict[str, HangVerdict] = {}
    started: list[float] = []
    for node in st.members:
        ns = view.node_status.get(node)
        if ns is None or ns.round != st.round or not isinstance(ns.hang, dict):
            continue
        try:
            reports[node] = HangVerdict.from_dict(ns.hang)
            started.append(float(ns.hang["at"]) - reports[node].stalled_s)
        except (KeyError, TypeError, ValueError):
            continue  # a report we cannot read is no evidence either way
    if not reports:
        return None
    # A frozen rank (stopped, stuck in the kernel: lazarus.agent.frozen) is the cause
    # whatever its peers do: nothing to hold for or to wait for.
    frozen = any(v.frozen for v in reports.values())
    busy = None if frozen else _peer_in_long_phase(now, view, st, set(reports), min(started))
    if busy is not None:
        return Decision([], f"hang reported by {', '.join(sorted(reports))}, but {busy}: "
                            "its peers wait for it; holding the report")
    first_report = min(float(view.node_status[n].hang["at"]) for n in reports)
    if not frozen and len(reports) < len(st.members) and now - first_report < HANG_REPORT_WAIT_S:
        return Decision([], f"hang reported by {', '.join(reports)}; waiting for the others")
    verdict = combine(reports)
    silent = sorted(set(st.members) - set(reports))
    if verdict.culprit_nodes:
        culprits, reason = list(verdict.culprit_nodes), verdict.reason
    elif silent:
        # Every reporting rank waits level with the others: the rank they wait for is on a
        # node that did not report (its agent is gone, or still waits on a rank that does
        # not answer), never on theirs.
        culprits = silent
        reason = f"{verdict.reason}; no report from {', '.join(silent)}"
    else:
        culprits, reason = sorted(reports), verdict.reason
    stacks = [_clip(str(view.node_status[n].hang.get("stacks"))) for n in reports]
    return _to_recovering(now, st, "hang", culprits,
                          f"hang: {reason}; {_allowance(reports, culprits)} "
                          f"(stacks: {', '.join(stacks)})",
                          min(started))


def _allowance(reports: dict[str, HangVerdict], culprits: list[str]) -> str:
    """The allowance that ran out, as the agent that reported it said it ("allowance 10.0 s
    = the 10 s floor (...)": lazarus.agent.hang), a culprit's where one reported."""
    node = next((n for n in culprits if n in reports),
                max(sorted(reports), key=lambda n: reports[n].stalled_s))
    verdict = reports[node]
    said = verdict.reason
    start = said.find("(allowance ")
    depth = 0
    for end in range(start, len(said)) if start >= 0 else ():
        depth += {"(": 1, ")": -1}.get(said[end], 0)
        if depth == 0:  # the parenthesis that opened it, closed
            return _clip(f"allowance on {node}: {said[start + len('(allowance '):end]}")
    return f"allowance on {node}: {verdict.timeout_s:.1f} s"  # a report that did not say


def _peer_in_long_phase(now: float, view: ClusterView, st: RunStatus, reporting: set[str],
                        stall_began: float) -> str | None:
    """Why a member that made no hang report may be what the reporters wait for: it is in a
    checkpoint or an eval (long by design; its own agent bounds those), or it left one after
    the stall began, and the reporters' agents withdraw their reports when their ranks move
    (HANG_REPORT_WAIT_S for that). Clocks of different hosts are compared here: NTP-close
    is close enough against allowances of seconds."""
    for node in st.members:
        ns = view.node_status.get(node)
        if node in reporting or ns is None or ns.round != st.round:
            continue
        lp = ns.long_phase if isinstance(ns.long_phase, dict) else {}
        since, until = _wall_time(lp.get("since"), now), _wall_time(lp.get("until"), now)
        # Past the agent's own allowance for the phase (it says which), its agent reports
        # that rank: hold no longer.
        allowance = lp.get("allowance_s")
        limit = (min(float(allowance), LONG_PHASE_LIMIT_S)
                 if isinstance(allowance, (int, float)) and not isinstance(allowance, bool)
                 and allowance > 0 else LONG_PHASE_LIMIT_S)
        if since is not None and now - since < limit + HANG_REPORT_WAIT_S:
            return f"{node} is in a checkpoint or an eval"
        if until is not None and until > stall_began and now - until < HANG_REPORT_WAIT_S:
            return f"{node} just left a checkpoint or an eval"
    return None


# An agent reports a rank that stays in a checkpoint or eval longer than its allowance, at
# most this (lazarus.agent.hang.HangConfig.long_cap_s), so no hold lasts longer.
LONG_PHASE_LIMIT_S = 600.0


def _wall_time(value, now: float) -> float | None:
    """A wall time from an agent's record, if it is one: garbage and the future are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 < value <= now + 60 else None


def _fault(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision | None:
    """A fault of the live round, answered: in a replica job, a fault inside some of its
    replicas restarts only those in the same pass (lazarus.daemon.replicaround)."""
    fault = _check_faults(now, view, st)
    if fault is None:
        return None
    return replicaround.respond(now, view, job, st, fault,
                                early_limit=min(EARLY_FAILURES, job.max_restarts + 1)) or fault


def _check_faults(now: float, view: ClusterView, st: RunStatus) -> Decision | None:
    lost = _lost(view, st)
    if lost:
        # Its agent was last heard of (a lease renewal) one TTL before the lease ran out: the
        # fault's time as well as anybody knows it, so that "detected after" means the same
        # for every kind of fault -- fault to detection (docs/architecture.md).
        ttl = max(view.departed_ttl.get(n) or settings.LEASE_TTL_S for n in lost)
        return _to_recovering(now, st, "node_lost", lost,
                              f"node(s) {', '.join(lost)} lost (agent lease expired)", now - ttl)
    stuck = _unkillable(now, view, st)
    if stuck is not None:
        return stuck
    sick = {n: health_of(view, n, "gpu") for n in st.members}
    sick = {n: why for n, (state, why) in sick.items() if state == H_FAILED}
    if sick:
        reason = "GPU failed on " + "; ".join(f"{n} ({', '.join(why)})" for n, why in sick.items())
        d = _to_recovering(now, st, "gpu_failed", list(sick), reason, now)
        return Decision([*(Cordon(n) for n in sick), *d.actions], d.reason)
    hang = _hang(now, view, st)
    if hang is not None:
        return hang
    failed = _failed(view, st)
    if not failed:
        return None
    fault_at = min(view.node_status[n].fault_at or now for n in failed)
    culprits = [n for n in failed if _primary(view, n)]
    if not culprits:
        # Only ranks that lost a peer so far: give the root cause time to show (a crash
        # report from another node, or a lease running out) so the culprit gets named.
        if now - fault_at < _peer_grace_s(view, st):
            return Decision([], f"rank(s) on {', '.join(failed)} lost a peer; waiting for the "
                                "root cause")
        return _to_recovering(now, st, "peer_lost", failed,
                              f"ranks on {', '.join(failed)} lost a peer and no root cause "
                              "showed up", fault_at)
    codes = {c for n in failed for c in view.node_status[n].exit_codes.values()}
    if exitcodes.REFUSED in codes:
        # The job cannot run as configured (another job's checkpoint dir): every restart
        # would refuse again. The ranks said why.
        why = next((view.node_status[n].refused for n in failed
                    if isinstance(view.node_status[n].refused, str)
                    and view.node_status[n].refused), "")
        reason = ("the job refused to run: " + (why or "a rank exited with REFUSED (see the "
                                                "worker logs)"))[:1000]
        status = dataclasses.replace(st, state=FAILED, since=now, incident=None, reason=reason)
        return Decision([SetStatus(status), Emit("failed", reason)], reason)
    if exitcodes.BAD_CHECKPOINT in codes and (st.restore or "").startswith(tier0.LABEL):
        # A copy in memory that does not load condemns nothing: the next round restores from
        # storage (tier0.failed_before); the workers send no finding for it to wait for.
        return _to_recovering(now, st, "bad_checkpoint", [st.restore],
                              f"restoring {st.restore} failed; restoring from storage", fault_at)
    if exitcodes.BAD_CHECKPOINT in codes and st.restore:
        return _restore_failed(now, view, st, failed, fault_at)
    details = [_clip(f"{n} rank {view.node_status[n].failed_rank} exit "
                     f"{view.node_status[n].exit_codes}") for n in culprits]
    output = next((view.node_status[n].output_tail for n in culprits
                   if view.node_status[n].output_tail), "")
    # A rank killed by a signal printed nothing about it: its last lines tell nothing then.
    exited = any(c > 0 for n in culprits for c in view.node_status[n].exit_codes.values())
    last = " | ".join(output.splitlines()[-OUTPUT_LINES:]) if exited else ""
    d = _to_recovering(now, st, "worker_crash", culprits,
                       f"worker crash on {'; '.join(details)}"
                       + (f"; last output: {_clip(last)}" if last else ""), fault_at,
                       **({"output_tail": output} if output else {}))
    if st.state != RENDEZVOUS:
        return d
    # Before the round ran: counted, so that a job that cannot start stops (see _recovering).
    how = ",".join(sorted({str(c) for n in culprits
                           for c in view.node_status[n].exit_codes.values()}))
    early = st.early_failures + 1 if how == st.early_failure else 1
    status = next(a.status for a in d.actions if isinstance(a, SetStatus))
    status = dataclasses.replace(status, early_failures=early, early_failure=how)
    return Decision([SetStatus(status) if isinstance(a, SetStatus) else a for a in d.actions],
                    d.reason)


def _restore_failed(now: float, view: ClusterView, st: RunStatus, failed: list[str],
                    fault_at: float) -> Decision:
    """The round could not restore its checkpoint: condemn it only for what is wrong with it,
    cordon a node that alone cannot read it (lazarus.daemon.restorefail)."""
    reports = {n: (view.node_status[n].restore_failed or None) if n in failed else None
               for n in st.members}
    waiting = [n for n, r in reports.items() if r is None]
    if waiting and now - fault_at < _peer_grace_s(view, st):
        return Decision([], f"restoring {st.restore} failed; waiting for what "
                            f"{', '.join(waiting)} found")
    verdict = restorefail.judge(reports)
    if verdict.cordon:
        why = "; ".join(f"{n}: {_clip(w)}" for n, w in verdict.cordon.items())
        d = _to_recovering(now, st, "checkpoint_unreadable", list(verdict.cordon),
                           f"checkpoint {st.restore} cannot be read on {why}; cordoned, the "
                           "checkpoint is kept", fault_at, why=why)
        return Decision([*(Cordon(n, _clip(w)) for n, w in verdict.cordon.items()),
                         *d.actions], d.reason)
    if verdict.storage:
        why = _clip(verdict.storage)
        return _to_recovering(now, st, "storage_unreadable", list(st.members),
                              f"no node can read checkpoint {st.restore} ({why}); it is kept "
                              "and tried again", fault_at, why=why)
    # Wrong with the checkpoint itself: mark it so the next round goes back to the one
    # before, instead of failing the same way.
    why = _clip(verdict.condemn)
    bad = [c for c in view.checkpoints if c.path == st.restore]
    d = _to_recovering(now, st, "bad_checkpoint", [st.restore],
                       f"checkpoint {st.restore} cannot be restored: {why}; marked bad, "
                       "falling back", fault_at, why=why)
    return Decision([*(MarkCheckpoint(c, good=False) for c in bad), *d.actions], d.reason)


def _host_swappable(view: ClusterView, node: str) -> bool:
    """The host monitor failed for a reason a spare can help with (lazarus.agent.host:
    memory exhaustion; not storage, whose drain would wait for a checkpoint it cannot take)."""
    ns = view.node_status.get(node)
    report = ns.health.get("host") if ns is not None and isinstance(ns.health, dict) else None
    return isinstance(report, dict) and report.get("swap") is True


def _planned_swap(view: ClusterView, job: JobSpec, st: RunStatus) -> Decision | None:
    """A degraded GPU (rising ECC, throttling) or a host running out of memory: swap the node
    out at a checkpoint, before it fails -- if a spare can take its place (else a shrink
    would cost more than the risk)."""
    spares = free_spares(view, job, st)
    if not spares:
        return None
    shared = hostalert.shared_fault({n: health_of(view, n, "host") for n in st.members})
    for node in st.members:
        if node in view.drains:
            continue
        gpu, gpu_why = health_of(view, node, "gpu")
        host, host_why = health_of(view, node, "host")
        if gpu == H_DEGRADED or (host == H_FAILED and not shared and _host_swappable(view, node)):
            kind = "gpu_degraded" if gpu == H_DEGRADED else "host_failed"
            msg = (f"{kind.replace('_', ' ')} on {node} ({', '.join(gpu_why + host_why)}): "
                   f"{replicaround.swap_said(job, spares[0])}")
            return Decision([RequestDrain(node, msg), Emit(kind, msg, {"node": node})], msg)
    return None


def _pending(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision:
    members = choose(view, job, [])
    if not job.start_on_spares:
        members = [m for m in members if view.nodes[m].role == ROLE_ACTIVE]
    waited = now - st.since
    # Actives before spares: an active node whose preflight is under way is waited for
    # rather than replaced by a spare that finished its own first.
    checking = sorted(n for n, rec in view.nodes.items() if rec.role == ROLE_ACTIVE
                      and n not in view.cordoned and preflight.verdict(view, n)[0] == "running")
    spares = [m for m in members if view.nodes[m].role != ROLE_ACTIVE]
    if checking and spares and waited < job.rendezvous_timeout_s:
        return Decision([], f"waiting for the preflight of {', '.join(checking)} before "
                            f"using spare(s) {', '.join(spares)}")
    if len(members) >= job.nodes or (len(members) >= job.min_nodes
                                     and waited >= job.rendezvous_timeout_s):
        return start_round(now, view, job, st, members, "first round", restarts=st.restarts)
    return Decision([], f"waiting for nodes: {len(members)} of {job.nodes} "
                        f"(min {job.min_nodes}) after {waited:.0f} s"
                        + ("" if job.start_on_spares else
                           "; spares are kept for faults (--spares-ok starts on them)"))


def _rendezvous(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision:
    done = replicaround.finished(now, view, job, st)
    if done is not None:
        return done
    fault = _fault(now, view, job, st)
    if fault is not None:
        return fault
    missing = [n for n in st.members if (s := view.node_status.get(n)) is None
               or s.round != st.round or s.workers not in (W_RUNNING, W_SUCCEEDED)]
    if not missing:
        status = dataclasses.replace(st, state=RUNNING, since=now, early_failures=0,
                                     early_failure="",
                                     reason=f"round {st.round}: all {len(st.members)} node(s) "
                                            "running")
        return Decision([SetStatus(status), Emit("running", status.reason)], status.reason)
    if now - st.since > job.rendezvous_timeout_s:
        return _to_recovering(now, st, "rendezvous_timeout", missing,
                              f"round {st.round}: {', '.join(missing)} did not start within "
                              f"{job.rendezvous_timeout_s:.0f} s", now)
    return Decision([], f"round {st.round}: waiting for {', '.join(missing)} to start")


# How many ranks of each reason a recovered event lists (its fields) and names (its message).
ANEW_RANKS_SHOWN = 8
ANEW_RANKS_SAID = 3


def _anew_said(anew: dict[str, list[int]]) -> str:
    """The ranks that started anew and why, shortest first, as sentences: "rank 1 started
    anew (failed first); 2 ranks started anew (new on this node)"."""
    def which(some: list[int]) -> str:
        if len(some) > ANEW_RANKS_SAID:
            return f"{len(some)} ranks"
        *head, last = map(str, sorted(some))
        return f"ranks {', '.join(head)} and {last}" if head else f"rank {last}"
    return "; ".join(f"{which(some)} started anew ({why})" for why, some in
                     sorted(anew.items(), key=lambda kv: (len(kv[1]), kv[0])))


def _running(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision:
    done = replicaround.finished(now, view, job, st)
    if done is not None:
        return done
    fault = _fault(now, view, job, st)
    if fault is not None:
        return fault
    statuses = [view.node_status.get(n) for n in st.members]
    if all(s is not None and s.round == st.round and s.workers == W_SUCCEEDED
           for s in statuses):
        status = dataclasses.replace(st, state=SUCCEEDED, since=now, incident=None,
                                     reason=f"all ranks finished in round {st.round}")
        return Decision([SetStatus(status), Emit("succeeded", status.reason)], status.reason)
    if st.incident is not None:
        # A replica round is back when every replica it restarted has stepped: the carried
        # ones' steps say nothing about them (lazarus.daemon.replicaround).
        healed = replicaround.healing(st, job.replicas)
        watched = statuses if healed is None else [
            view.node_status.get(n) for nodes in healed.values() for n in nodes]
        # A script that reports no steps (level 0) is back once its ranks joined their
        # process groups: the round runs. (A replica job's ranks, the built-in trainer's,
        # report steps: joined, a restarted replica has not healed yet.)
        progressed = [s for s in watched if s is not None and s.round == st.round
                      and (s.step > st.restore_step or s.step == 0 and s.workers == W_RUNNING
                           and healed is None)]
        stepped = {r: [s.step for s in progressed if s.node in nodes]
                   for r, nodes in (healed or {}).items()}
        if progressed and all(stepped.values()):
            inc = st.incident
            step = max(s.step for s in progressed)
            mine = [s for s in watched if s is not None and s.round == st.round]
            kept, ranks = sum(len(s.in_place) for s in mine), sum(len(s.pids) for s in mine)
            anew: dict[str, list[int]] = {}
            for s in mine:
                for why, some in s.anew.items():
                    anew.setdefault(why, []).extend(some)
            # When the step was done: the agent's status that told of it was made then (its
            # ranks' report plus at most an agent pass), where this pass comes a watch event
            # and a pass interval later (0.2-0.7 s measured here). A time outside the fault
            # .. now (another host's clock) falls back to this pass's.
            done_at = max(s.updated_at for s in progressed)
            if not inc["fault_at"] <= done_at <= now:
                done_at = now
            fields = {**inc, "recovered_at": now, "first_step": step, "step_done_at": done_at,
                      "recovered_after_s": round(done_at - inc["fault_at"], 3),
                      "detected_after_s": round(inc["detected_at"] - inc["fault_at"], 3),
                      "in_place_ranks": kept, "path": "in_place" if kept else "restart",
                      # bounded: a few ranks per reason, at any size of job
                      "anew": {why: len(some) for why, some in anew.items()},
                      "anew_ranks": {why: sorted(some)[:ANEW_RANKS_SHOWN]
                                     for why, some in anew.items()}}
            msg = (f"recovered from {inc['kind']} ({inc['culprit']}): "
                   + (f"step {step} done" if step else "every rank joined its process group")
                   + f" {fields['recovered_after_s']:.1f} s after the fault"
                   + (f"; {kept} of {ranks} rank(s) in place" if kept else "")
                   + (f"; {_anew_said(anew)}" if anew else ""))
            status = dataclasses.replace(st, incident=None, reason=msg)
            joined = [Emit("replica_joined", f"replica {r} ({', '.join(healed[r])}) healed "
                                             f"from a live peer: step {max(steps)} done",
                           {"replica": r, "step": max(steps)}) for r, steps in stepped.items()]
            return Decision([SetStatus(status), Emit("recovered", msg, fields), *joined], msg)
    alert = hostalert.respond(st, {n: health_of(view, n, "host") for n in st.members})
    if alert is not None:
        return alert
    swap = (_planned_swap(view, job, st) or stragglers.respond(view, job, st)
            or stragglers.recovered(view, job, st))
    if swap is not None:
        return swap
    rolled_back = spikes.rollback(now, view, job, st)
    if rolled_back is not None:
        return rolled_back
    command = commands.while_running(now, view, job, st)
    if command is not None:
        return command
    if len(st.members) < job.nodes:
        current = set(st.members)
        spare = [n for n in usable(view, job) if n not in current]
        ckpt = restore_point(view, job)
        if spare and ckpt is not None and ckpt.round == st.round and ckpt.step > st.restore_step:
            members = choose(view, job, st.members)
            return start_round(now, view, job, st, members,
                                f"grow to {len(members)} node(s) at checkpoint step "
                                f"{ckpt.step} ({', '.join(m for m in members if m not in current)} "
                                "joins)", restarts=st.restarts)
    return Decision([], f"round {st.round} running on {len(st.members)} node(s)")


def _recovering(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision:
    if st.early_failures >= min(EARLY_FAILURES, job.max_restarts + 1):
        status = dataclasses.replace(
            st, state=FAILED, since=now,
            reason=(f"every one of the last {st.early_failures} rounds crashed before it "
                    f"ran (exit {st.early_failure}): the job cannot start; last fault: "
                    f"{st.reason}")[:1000])
        return Decision([SetStatus(status), Emit("failed", status.reason)], status.reason)
    if st.restarts >= job.max_restarts:
        status = dataclasses.replace(st, state=FAILED, since=now,
                                     reason=f"gave up after {st.restarts} restarts "
                                            f"(max_restarts); last fault: {st.reason}")
        return Decision([SetStatus(status), Emit("failed", status.reason)], status.reason)
    members = choose(view, job, st.members)
    if len(members) >= job.min_nodes:
        current = set(st.members)
        kept = [n for n in members if n in current]
        added = [n for n in members if n not in current]
        why = f"recovery {st.restarts + 1}: keep {', '.join(kept) or 'none'}" + (
            f", promote {', '.join(added)}" if added else "") + (
            f", shrink to {len(members)} of {job.nodes}" if len(members) < job.nodes else "")
        return start_round(now, view, job, st, members, why, restarts=st.restarts + 1)
    waited = now - st.since
    if waited > job.rendezvous_timeout_s:
        status = dataclasses.replace(st, state=FAILED, since=now,
                                     reason=f"only {len(members)} usable node(s), need "
                                            f"{job.min_nodes}, after {waited:.0f} s")
        return Decision([SetStatus(status), Emit("failed", status.reason)], status.reason)
    return Decision([], f"recovering: {len(members)} usable node(s), need {job.min_nodes}")


_HANDLERS = {PENDING: _pending, RENDEZVOUS: _rendezvous, RUNNING: _running,
             RECOVERING: _recovering, PAUSED: commands.paused}
