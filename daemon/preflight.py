"""Preflight, as pure policy: a node whose agent's checks failed (lazarus.agent.preflight) is
cordoned with the reason, and takes no work; one that has not passed them yet waits.

The agent runs its checks when it starts and every few minutes while its node runs no ranks,
and keeps the last verdict in its node status. A failure cordons the node (`cordon/<node>`,
written as the leader's, with the reason) and is an event; when a later run passes, the
leader lifts that cordon itself -- never one an operator made. A node whose agent says it
runs preflight (NodeRecord.preflight) and whose status has no verdict yet is not chosen for
a round either: its checks are under way.
"""

from __future__ import annotations

from lazarus.core.records import number
from lazarus.daemon.actions import Cordon, Decision, Emit, Uncordon
from lazarus.daemon.view import ClusterView

PASSED, FAILED = "passed", "failed"
BY = "preflight"


def verdict(view: ClusterView, node: str) -> tuple[str, str, float]:
    """(state, reason, cost in seconds) of the node's last preflight: state is "passed",
    "failed", "running" (the agent runs checks, none has finished) or "" (it runs none).
    What an agent wrote is read defensively: a status is JSON of any shape inside."""
    ns = view.node_status.get(node)
    doc = ns.preflight if ns is not None and isinstance(ns.preflight, dict) else {}
    state = doc.get("state")
    if state in (PASSED, FAILED):
        reason = doc.get("reason") if isinstance(doc.get("reason"), str) else ""
        cost = number(doc.get("cost_s"))
        return state, reason[:300], cost if cost is not None and cost >= 0 else 0.0
    rec = view.nodes.get(node)
    return ("running" if rec is not None and rec.preflight else ""), "", 0.0


def blocked(view: ClusterView, node: str) -> bool:
    """The node may not join a round: its preflight failed, or has not finished yet."""
    return verdict(view, node)[0] in (FAILED, "running")


def respond(view: ClusterView) -> Decision | None:
    """Cordon each registered node whose preflight failed; lift the cordons made so whose
    preflight passed since."""
    actions: list = []
    cordoned, released = [], []
    for node in sorted(view.nodes):
        state, reason, _ = verdict(view, node)
        if state == FAILED and node not in view.cordoned:
            msg = f"{node} failed its preflight: {reason or 'no reason given'}; cordoned"
            actions += [Cordon(node, reason=reason, by=BY),
                        Emit("preflight_failed", msg, {"node": node, "culprit": node,
                                                       "reason": reason})]
            cordoned.append(node)
        elif state == PASSED and view.cordon_by.get(node) == BY:
            actions += [Uncordon(node),
                        Emit("preflight_passed", f"{node} passed its preflight again: "
                                                 "uncordoned", {"node": node})]
            released.append(node)
    if not actions:
        return None
    parts = ([f"preflight failed on {', '.join(cordoned)}: cordoned"] if cordoned else []) + (
        [f"preflight passed on {', '.join(released)}: uncordoned"] if released else [])
    return Decision(actions, "; ".join(parts))
