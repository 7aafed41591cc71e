"""Loss-spike policy: when the trainer guard keeps skipping steps, roll back. Pure.

The trainer handles one spike alone: it skips that batch (docs/architecture.md, "Failure
classes"). Spikes that repeat within `window_steps` mean the model or the data went bad:
restore the last GOOD checkpoint (no spike within `good_after_steps` after it, so one taken
just before the trouble is never used), skip the data window the spikes came from in every
later round, optionally lower the LR for a while, and mark the checkpoints of the abandoned
stretch as not good.
"""

from __future__ import annotations

import dataclasses

from lazarus.core.jobspec import JobSpec
from lazarus.core.policy import SpikePolicy
from lazarus.core.records import CheckpointRecord, RunStatus
from lazarus.daemon import ckptcheck
from lazarus.daemon.actions import Decision, Emit, MarkCheckpoint
from lazarus.daemon.rounds import start_round
from lazarus.daemon.view import ClusterView


def _spikes(view: ClusterView, st: RunStatus) -> dict[int, list[int]]:
    """step -> data window [first, last] of the round's skipped steps, from every member.
    Malformed entries (a buggy or foreign agent) are ignored."""
    out: dict[int, list[int]] = {}
    for node in st.members:
        ns = view.node_status.get(node)
        if ns is None or ns.round != st.round:
            continue
        for sp in ns.spikes:
            window = sp.get("window") if isinstance(sp, dict) else None
            step = sp.get("step") if isinstance(sp, dict) else None
            if (_is_int(step) and isinstance(window, list) and len(window) == 2
                    and all(map(_is_int, window)) and window[0] <= window[1]):
                out[step] = window
    return out


def _is_int(x) -> bool:
    return type(x) is int  # not a bool: a window of `true` would go into run/status


def good_checkpoint(view: ClusterView, job: JobSpec, spike_steps: list[int],
                    policy: SpikePolicy) -> CheckpointRecord | None:
    first = min(spike_steps)
    for c in reversed(view.checkpoints):
        if c.job_id != job.id or not c.good or c.step >= first:
            continue
        if ckptcheck.why_not(c, job) is not None:  # a forged record (rounds.checked_restore_point)
            continue
        if not any(c.step < s <= c.step + policy.good_after_steps for s in spike_steps):
            return c
    return None


def rollback(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision | None:
    policy = job.spike_policy
    spikes = _spikes(view, st)
    if not spikes:
        return None
    latest = max(spikes)
    recent = sorted(s for s in spikes if s > latest - policy.window_steps)
    if len(recent) < policy.max_spikes:
        return None
    good = good_checkpoint(view, job, sorted(spikes), policy)
    # From the first spike's data to what the run has read since: a poisoned stretch keeps
    # going past the spikes seen so far, and skipping only those would spike again.
    read = [w[1] for n in st.members if (ns := view.node_status.get(n)) is not None
            and ns.round == st.round and isinstance(w := ns.window, list) and len(w) == 2
            and all(map(_is_int, w))]
    window = [min(spikes[s][0] for s in recent),
              max([spikes[s][1] for s in recent] + read)]
    restore_step = good.step if good else 0
    lowered = policy.lr_scale < 1.0 and policy.lr_scale_steps > 0
    incident = {"kind": "loss_spike", "culprit": f"data {window[0]}..{window[1]}",
                "fault_at": now, "detected_at": now, "round": st.round,
                "spike_steps": recent, "restore_step": restore_step}
    rolled = dataclasses.replace(
        st, skip_windows=[*st.skip_windows, window], incident=incident,
        lr_scale=policy.lr_scale if lowered else st.lr_scale,
        lr_scale_until=restore_step + policy.lr_scale_steps if lowered else st.lr_scale_until)
    reason = (f"{len(recent)} loss spikes at steps {recent} within {policy.window_steps} steps: "
              f"roll back to good checkpoint step {restore_step}, skip data "
              f"{window[0]}..{window[1]}"
              + (f", LR x{policy.lr_scale} for {policy.lr_scale_steps} steps" if lowered else ""))
    decision = start_round(now, view, job, rolled, list(st.members), reason,
                           restarts=st.restarts + 1, restore=good)
    abandoned = [MarkCheckpoint(c, good=False) for c in view.checkpoints
                 if c.job_id == job.id and c.good and c.step > restore_step]
    detected = Emit("fault_detected", reason, {**incident, "skip_window": window})
    return Decision([detected, *decision.actions, *abandoned], decision.reason)
