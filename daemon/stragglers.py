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


def swap_pays(gain_s_per_step: float, swap_cost_s: float,
              remaining_steps: int) -> tuple[bool, str]:
    """Whether replacing a straggler pays: the time it saves over the rest of the run against
    what the swap costs (checkpoint, rendezvous, restore), with SWAP_MARGIN to spare."""
    saved = gain_s_per_step * remaining_steps
    worth = saved > SWAP_MARGIN * swap_cost_s
    return worth, (f"a swap {'pays' if worth else 'does not pay'}: it saves ~{saved:.0f} s over "
                   f"{remaining_steps} steps against {swap_cost_s:g} s x{SWAP_MARGIN:g}")


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
        pays, why = swap_pays(s.gain_s_per_step, cost, remaining)
        if pays and spares:
            msg = f"straggler: {s.reason}; {why}: checkpoint, then swap in {spares[0]}"
            return Decision([RequestDrain(node, msg),
                             Emit("straggler", msg, _fields(s, node, step, swap=spares[0]))], msg)
        seen = st.stragglers.get(node)
        if isinstance(seen, dict) and seen.get("round") == st.round:
            continue  # already reported in this round (anything else there: report again)
        msg = (f"straggler: {s.reason}; " + (f"{why}: kept" if spares else
                                               "no spare idle: kept"))
        flagged = {**st.stragglers, node: {"round": st.round, "reason": s.reason}}
        return Decision([SetStatus(dataclasses.replace(st, stragglers=flagged)),
                         Emit("straggler", msg, _fields(s, node, step, swap=None))], msg)
    return None


def _fields(s: Straggler, node: str, step: int, *, swap: str | None) -> dict:
    return {"node": node, "culprit": node, "step": step, "rank": s.rank, "ratio": round(s.ratio, 3),
            "slow_steps": s.slow_steps, "of_steps": s.of_steps,
            "gain_s_per_step": round(s.gain_s_per_step, 4), "swap_to": swap}
