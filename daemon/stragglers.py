"""Stragglers across the nodes of a run, as pure policy (docs/architecture.md, "Failure
classes": flag; evict and swap when a spare is idle and the cost model says so).

Every agent publishes a summary of its ranks' last steps (lazarus.core.throughput); all
members' ranks are judged together against the run's median, so a node whose ranks are all
slow is caught as well as one slow rank among fast ones. One judgement costs O(ranks log
ranks) and is made once per view: decide() and ListNodes share it.
"""

from __future__ import annotations

import dataclasses

from lazarus.core.throughput import Straggler, ThroughputConfig, judge, read_summary
from lazarus.core.jobspec import JobSpec
from lazarus.core.records import W_RUNNING, RunStatus
from lazarus.daemon.actions import Decision, Emit, RequestDrain, SetStatus
from lazarus.daemon import replicaround
from lazarus.daemon.rounds import free_spares
from lazarus.daemon.view import ClusterView

# The gain is an estimate and the spare may be no faster: a swap must pay this many times over.
SWAP_MARGIN = 2.0


def find(view: ClusterView, job: JobSpec, st: RunStatus) -> list[Straggler]:
    pol = job.straggler_policy
    config = ThroughputConfig(margin=pol.straggler_margin, min_slow=pol.straggler_steps)
    deps = (view.revision, st.round, tuple(st.members), config.margin, config.min_slow)
    memo = view.memo.get("stragglers")
    if memo is not None and memo[0] == deps:
        return memo[1]
    # A node's summary is read again only when its status is a new record: a view kept up to
    # date in place re-reads the few nodes that wrote since, not all of them.
    known = view.memo.get("summaries", {})
    summaries, ranks = {}, []
    for node in st.members:
        ns = view.node_status.get(node)
        if ns is None or ns.round != st.round or ns.workers != W_RUNNING:
            continue
        hit = known.get(node)
        if hit is None or hit[0] is not ns:
            hit = (ns, read_summary(node, ns.throughput, window=config.window))
        summaries[node] = hit
        ranks.extend(hit[1])
    found = judge(ranks, config)
    view.memo["summaries"], view.memo["stragglers"] = summaries, (deps, found)
    return found


def swap_pays(gain_s_per_step: float, swap_cost_s: float, remaining_steps: int, *,
              slow_steps: int, step_s: float) -> tuple[bool, str]:
    """Whether replacing a straggler pays, on evidence proportional to what a swap costs
    (docs/architecture.md, "Stragglers"): the node has been slow for at least as long as a
    swap takes (`slow_steps` x `step_s` >= `swap_cost_s`), and what the swap saves, projected
    over no more steps than it has been slow for (nor than the run has left), exceeds its
    cost (checkpoint, rendezvous, restore) SWAP_MARGIN times over. A passing slowdown (a noisy
    neighbour, a flush, a page-cache storm) is over before it has earned a swap."""
    lasted = slow_steps * step_s
    horizon = max(0, min(remaining_steps, slow_steps))
    saved = gain_s_per_step * horizon
    if lasted < swap_cost_s:
        return False, (f"a swap does not pay yet: slow for {slow_steps} steps ({lasted:.0f} s), "
                       f"less than the {swap_cost_s:g} s a swap costs")
    worth = saved > SWAP_MARGIN * swap_cost_s
    return worth, (f"a swap {'pays' if worth else 'does not pay'}: slow for {slow_steps} steps "
                   f"({lasted:.0f} s), it saves ~{saved:.0f} s over the next {horizon} steps "
                   f"against {swap_cost_s:g} s x{SWAP_MARGIN:g}")


def _since(seen: object, st: RunStatus, s: Straggler, step: int) -> int:
    """The step from which `s` has been slow without a break in this round: from its record in
    the run status (written when first reported), else from its window now."""
    if isinstance(seen, dict) and seen.get("round") == st.round:
        since = seen.get("since_step")
        if isinstance(since, int) and not isinstance(since, bool) and 0 <= since <= step:
            return since
    return max(0, step - s.slow_steps)


def respond(view: ClusterView, job: JobSpec, st: RunStatus) -> Decision | None:
    found = find(view, job, st)
    if not found:
        return None
    by_node: dict[str, Straggler] = {}
    for s in found:  # a node is as slow as its slowest rank
        if s.node not in by_node or s.ratio > by_node[s.node].ratio:
            by_node[s.node] = s
    step = max((view.node_status[n].step for n in st.members if n in view.node_status),
               default=0)
    remaining = max(0, int(job.train.get("steps", 0)) - step)
    spares = free_spares(view, job, st)
    cost = job.straggler_policy.swap_cost_s
    for node, s in sorted(by_node.items()):
        if node in view.drains:
            continue
        seen = st.stragglers.get(node)
        since = _since(seen, st, s, step)
        pays, why = swap_pays(s.gain_s_per_step, cost, remaining, slow_steps=step - since,
                              step_s=s.step_s)
        if pays and spares:
            msg = f"straggler: {s.reason}; {why}: {replicaround.swap_said(job, spares[0])}"
            return Decision([RequestDrain(node, msg),
                             Emit("straggler", msg, _fields(s, node, step, swap=spares[0]))], msg)
        if isinstance(seen, dict) and seen.get("round") == st.round:
            continue  # already reported in this round (anything else there: report again)
        msg = (f"straggler: {s.reason}; " + (f"{why}: kept" if spares else
                                               "no spare idle: kept"))
        flagged = {**st.stragglers, node: {"round": st.round, "reason": s.reason,
                                           "since_step": since}}
        return Decision([SetStatus(dataclasses.replace(st, stragglers=flagged)),
                         Emit("straggler", msg, _fields(s, node, step, swap=None))], msg)
    return None


def recovered(view: ClusterView, job: JobSpec, st: RunStatus) -> Decision | None:
    """Forget a reported straggler of this round that is clearly no longer slow: its slowness
    passed, and if it comes back its evidence starts again. "Clearly": not even half as slow,
    in half as many steps, as a report needs, whatever its peers do -- a node hovering at the
    bar must not lose its record, and with it the time it has been slow, at every dip. One
    write per change, none per pass."""
    mine = {n for n, v in st.stragglers.items() if isinstance(v, dict) and v.get("round") == st.round}
    if not mine:
        return None
    find(view, job, st)  # reads the members' summaries into the view's memo
    # A node is judged only while every member reports a full window: absence of evidence in
    # a pass where nobody is judged is not recovery.
    if not _judged(view, st):
        return None
    pol = job.straggler_policy
    relaxed = ThroughputConfig(margin=1 + (pol.straggler_margin - 1) / 2,
                               min_slow=max(1, pol.straggler_steps // 2),
                               contention=float("inf"))
    summaries = view.memo["summaries"]
    slow = {s.node for s in judge([r for n in st.members for r in summaries[n][1]], relaxed)}
    gone = sorted(mine - slow)
    if not gone:
        return None
    kept = {n: v for n, v in st.stragglers.items() if n not in gone}
    msg = f"straggler: {', '.join(gone)} no longer slow"
    return Decision([SetStatus(dataclasses.replace(st, stragglers=kept))], msg)


def _judged(view: ClusterView, st: RunStatus) -> bool:
    summaries = view.memo.get("summaries", {})
    return all(n in summaries and summaries[n][1] for n in st.members)


def _fields(s: Straggler, node: str, step: int, *, swap: str | None) -> dict:
    return {"node": node, "culprit": node, "step": step, "rank": s.rank, "ratio": round(s.ratio, 3),
            "slow_steps": s.slow_steps, "of_steps": s.of_steps,
            "slow_samples": s.slow_samples or s.slow_steps, "of_samples": s.of_samples or s.of_steps,
            "span_s": round(s.span_s, 2),
            "gain_s_per_step": round(s.gain_s_per_step, 4), "swap_to": swap}
