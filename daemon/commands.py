"""What operators ask for through the API (as keys under commands/), as pure policy.

- cancel: the run ends as CANCELLED; agents stop its workers.
- drain NODE: if NODE runs ranks, ask for a checkpoint, and once one is committed after the
  request, start a new round without NODE (a spare takes its place, else the run shrinks);
  NODE stays cordoned. A node that runs nothing is cordoned at once. In a job of replica
  groups only NODE's replica restarts, on a spare, and heals from a live one: no checkpoint
  (lazarus.daemon.replicaround.move; the whole-world drain where it cannot).
- pause: checkpoint the same way, then PAUSED (workers stopped); deleting the key resumes
  from that checkpoint.
"""

from __future__ import annotations

import dataclasses

from lazarus.core.jobspec import JobSpec
from lazarus.core.records import CANCELLED, PAUSED, RENDEZVOUS, RUNNING, RunStatus
from lazarus.daemon.actions import (ClearCommand, Cordon, Decision, Emit, RequestCheckpoint,
                                    SetStatus)
from lazarus.daemon import preflight, replicaround
from lazarus.daemon.rounds import choose, start_round
from lazarus.daemon.view import ClusterView


def immediate(now: float, view: ClusterView, st: RunStatus) -> Decision | None:
    """Commands that act in any live state."""
    if view.cancel_requested and view.cancel_job_id not in (None, "", st.job_id):
        msg = f"ignored a cancel meant for run {view.cancel_job_id} (this run is {st.job_id})"
        return Decision([ClearCommand("cancel"), Emit("cancel_ignored", msg)], msg)
    if view.cancel_requested:
        status = dataclasses.replace(st, state=CANCELLED, since=now, incident=None,
                                     reason="cancelled by the operator")
        return Decision([SetStatus(status), ClearCommand("cancel"),
                         Emit("cancelled", status.reason)], status.reason)
    idle = sorted(n for n in view.drains
                  if n not in st.members or st.state not in (RUNNING, RENDEZVOUS))
    if idle:
        actions = [a for n in idle for a in (Cordon(n), ClearCommand(f"drain/{n}"))]
        msg = f"drained {', '.join(idle)} (no ranks there): cordoned"
        return Decision(actions + [Emit("drained", msg, {"nodes": idle})], msg)
    return None


def _checkpoint_after(view: ClusterView, job: JobSpec, revision: int) -> int | None:
    """Step of a checkpoint of this job committed after `revision`, if any."""
    steps = [c.step for c in view.checkpoints
             if c.job_id == job.id and view.checkpoint_revision.get(c.step, 0) > revision]
    return max(steps, default=None)


def _await_checkpoint(view: ClusterView, revision: int, why: str) -> Decision:
    if view.checkpoint_request_revision > revision:
        return Decision([], f"{why}: waiting for the requested checkpoint")
    return Decision([RequestCheckpoint(f"{why.replace(' ', '-')}-{revision}")],
                    f"{why}: checkpoint requested")


def while_running(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision | None:
    """Drain and pause of a running round: both wait for a checkpoint committed after them."""
    drained = sorted(n for n in view.drains if n in st.members)
    if drained:
        # In a replica job only the drained nodes' replicas move, with no checkpoint.
        moved = replicaround.move(now, view, job, st, drained)
        if moved is not None:
            done = [a for n in drained for a in (Cordon(n), ClearCommand(f"drain/{n}"))]
            return Decision(moved.actions + (done if moved.actions else []), moved.reason)
        since = max(view.drains[n] for n in drained)
        step = _checkpoint_after(view, job, since)
        if step is None:
            return _await_checkpoint(view, since, f"drain {','.join(drained)}")
        without = dataclasses.replace(view, cordoned=view.cordoned | set(drained))
        members = choose(without, job, [m for m in st.members if m not in drained])
        checking = _checking(now, without, job, set(members) | set(drained))
        if len(members) < job.nodes and checking:
            # A planned move: shrinking now and growing again once the node is ready costs
            # two recoveries where a short wait costs none.
            return Decision([], f"drain {','.join(drained)}: waiting for the preflight of "
                                f"{', '.join(checking)} rather than shrink to {len(members)} "
                                f"node(s) (up to {job.rendezvous_timeout_s:.0f} s after it "
                                f"registered)")
        if len(members) < job.min_nodes:
            return Decision([], f"drain {','.join(drained)}: would leave {len(members)} "
                                f"node(s), below min_nodes {job.min_nodes}; waiting for a spare")
        round_ = start_round(now, without, job, st, members,
                             f"drain {', '.join(drained)} after checkpoint step {step}",
                             restarts=st.restarts)
        extra = [a for n in drained for a in (Cordon(n), ClearCommand(f"drain/{n}"))]
        return Decision(round_.actions + extra, round_.reason)
    if view.pause_revision is not None:
        step = _checkpoint_after(view, job, view.pause_revision)
        if step is None:
            return _await_checkpoint(view, view.pause_revision, "pause")
        status = dataclasses.replace(st, state=PAUSED, since=now, restore_step=step,
                                     reason=f"paused by the operator after checkpoint step {step}")
        return Decision([SetStatus(status), Emit("paused", status.reason)], status.reason)
    return None


def _checking(now: float, view: ClusterView, job: JobSpec, taken: set[str]) -> list[str]:
    """Nodes that could join the round once their preflight, still under way, passes: for up
    to the job's rendezvous timeout after they registered (a preflight that takes longer is
    not waited for: its node's checks are stuck, or it is too slow to be the one to wait on)."""
    return sorted(n for n, rec in view.nodes.items()
                  if n not in taken and n not in view.cordoned
                  and preflight.verdict(view, n)[0] == "running"
                  and now - rec.started_at < job.rendezvous_timeout_s)


def paused(now: float, view: ClusterView, job: JobSpec, st: RunStatus) -> Decision:
    if view.pause_revision is not None:
        return Decision([], f"paused at step {st.restore_step} (resume: lazarus resume)")
    members = choose(view, job, st.members)
    if len(members) < job.min_nodes:
        return Decision([], f"resume: {len(members)} usable node(s), need {job.min_nodes}")
    return start_round(now, view, job, st, members, "resumed by the operator",
                       restarts=st.restarts)
