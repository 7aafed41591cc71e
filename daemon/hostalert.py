"""Host alerts, as pure policy (docs/architecture.md, "Failure classes": disk full /
checkpoint dir unwritable / mount lost -> alert; the run goes on).

A member whose host monitor fails (lazarus.agent.host: no room for the next checkpoint, the
directory unwritable or gone, a required mount missing, memory nearly exhausted) is alerted
once when it enters that state and once when it leaves it. run/status remembers who is in
alert, so a decision applied twice or a new leader does not repeat the event. Nothing is
restarted: a save the storage refuses costs that checkpoint only (lazarus.trainer.ckptrefusal),
and the last committed one stays the restore point. Swapping a node whose own disk failed for
a spare is decide._planned_swap's business.
"""

from __future__ import annotations

import dataclasses

from lazarus.core.records import H_FAILED, RunStatus
from lazarus.daemon.actions import Decision, Emit, SetStatus


def shared_fault(host: dict[str, tuple[str, list[str]]]) -> bool:
    """Every member's host fails: the storage they share is at fault, not one node, and
    swapping a node out cannot help. (One member alone cannot tell the two apart.)"""
    return len(host) > 1 and all(state == H_FAILED for state, _ in host.values())


def respond(st: RunStatus, host: dict[str, tuple[str, list[str]]]) -> Decision | None:
    """`host`: (state, reasons) of each member's host monitor (decide.health_of)."""
    failing = {n: why for n, (state, why) in host.items() if state == H_FAILED}
    if set(failing) == set(st.host_alerts):
        return None
    entered = sorted(n for n in failing if n not in st.host_alerts)
    # A node that left the run is no longer our concern: dropped without an event.
    left = sorted(n for n in st.host_alerts if n not in failing and n in host)
    actions: list = [SetStatus(dataclasses.replace(st, host_alerts=failing))]
    for n in entered:
        msg = (f"host alert on {n}: {'; '.join(failing[n]) or 'host monitor failed'}; "
               "training goes on, checkpoints the storage refuses are skipped")
        actions.append(Emit("host_alert", msg, {"node": n, "culprit": n,
                                                "reasons": failing[n]}))
    for n in left:
        actions.append(Emit("host_alert_cleared", f"host of {n} is healthy again",
                            {"node": n}))
    parts = ([f"host alert on {', '.join(entered)}"] if entered else []) + (
        [f"host of {', '.join(left)} healthy again"] if left else [])
    return Decision(actions, "; ".join(parts) or "host alerts updated")
