"""Choosing a round: its members (topology: actives first, a node's ranks together), its
rank order, its store and the checkpoint it restores. Pure helpers of the policy."""

from __future__ import annotations

import dataclasses

from lazarus.core.jobspec import JobSpec
from lazarus.core.records import (MAX_ROUND, RECOVERING, RENDEZVOUS, ROLE_ACTIVE, CheckpointRecord,
                                  RoundRecord, RunStatus)
from lazarus.daemon import ckptcheck, preflight
from lazarus.daemon import tier0
from lazarus.daemon.actions import Decision, Emit, SetStatus, StartRound
from lazarus.daemon.view import ClusterView


def usable(view: ClusterView, job: JobSpec) -> list[str]:
    """Nodes that may take work: registered, not cordoned, with enough ranks, not held back
    by their preflight; actives first."""
    ok = [n for n, rec in view.nodes.items()
          if n not in view.cordoned and rec.nproc >= job.nproc_per_node
          and not preflight.blocked(view, n)]
    return sorted(ok, key=lambda n: (view.nodes[n].role != ROLE_ACTIVE, n))


def choose(view: ClusterView, job: JobSpec, keep: list[str]) -> list[str]:
    members = [n for n in keep if n in view.nodes and n not in view.cordoned][: job.nodes]
    chosen = set(members)
    for n in usable(view, job):
        if len(members) >= job.nodes:
            break
        if n not in chosen:
            members.append(n)
            chosen.add(n)
    return members


def restore_point(view: ClusterView, job: JobSpec) -> CheckpointRecord | None:
    return checked_restore_point(view, job)[0]


def checked_restore_point(view: ClusterView,
                          job: JobSpec) -> tuple[CheckpointRecord | None, list[Emit]]:
    """The newest good record of `job` that passes lazarus.daemon.ckptcheck, and an event for
    each newer one that did not (agents write these records; any agent may forge one)."""
    refused = []
    for c in reversed(view.checkpoints):
        if not c.good or c.job_id != job.id:
            continue
        why = ckptcheck.why_not(c, job)
        if why is None:
            return c, refused
        refused.append(Emit("checkpoint_refused",
                            f"checkpoint record of step {c.step} not restored: {why}",
                            {"step": c.step, "path": c.path[:256], "reason": why}))
    return None, refused


_LATEST = object()


def round_train_config(job: JobSpec, st: RunStatus, n_nodes: int, restore_step: int) -> dict:
    """The trainer config of a round: the job's [train] with dp for `n_nodes`, plus what
    earlier rollbacks ordered (data windows to skip, a lowered LR for a while)."""
    lowered = st.lr_scale < 1.0 and st.lr_scale_until > restore_step
    return job.train_config_for(
        n_nodes, good_after_steps=job.spike_policy.good_after_steps,  # retention keeps a good one
        skip_windows=st.skip_windows,
        lr_scale=(st.lr_scale, st.lr_scale_until - restore_step) if lowered else None)


def start_round(now: float, view: ClusterView, job: JobSpec, st: RunStatus,
                members: list[str], reason: str, *, restarts: int,
                restore=_LATEST) -> Decision:
    """`restore`: the checkpoint to resume from (a CheckpointRecord or None for a fresh start);
    by default the newest step every shard has, in memory (tier 0) or on storage (tier 1)."""
    n = max(st.round, view.last_round) + 1
    if n >= MAX_ROUND:  # what we wrote, we could not read back
        return Decision([], f"no round after round {n - 1}, the last a key can number: "
                            "delete the round records that are not the run's")
    first = view.nodes[members[0]]
    world = job.world_size(len(members))
    # A replica job (docs/replicas.md): every round of it that starts the whole world starts
    # each replica anew from the same checkpoint on storage (the newest good record), and its
    # trainer config is one replica's. Its ranks take no tier-0 copies, so no holder is
    # waited for and memory is never chosen.
    replicas = job.replicas if job.failure_unit == "replica" else 1
    refused: list[Emit] = []
    if restore is _LATEST:
        ckpt, refused = checked_restore_point(view, job)
    else:
        ckpt = restore
    memory = None
    if restore is _LATEST and replicas == 1:
        waiting = _stale_holdings(now, view, st)
        if waiting:
            return Decision([], f"round {n}: waiting up to {tier0.FRESH_WAIT_S:.0f} s for "
                                f"{', '.join(waiting)} to report their in-memory copies",
                            awaiting=tuple(waiting))
        memory = tier0.choose(
            tier0=tier0.newest_in_memory(
                {node: s.tier0 for node, s in view.node_status.items() if node in view.nodes},
                job_id=job.id, world_size=world, members=members, nproc=job.nproc_per_node),
            tier1_step=ckpt.step if ckpt else None, tier0_failed=tier0.failed_before(st.incident))
    step = memory.step if memory else ckpt.step if ckpt else 0
    train = round_train_config(job, st, len(members) // replicas, step)
    record = RoundRecord(
        round=n, job_id=job.id, members=members, nproc_per_node=job.nproc_per_node,
        world_size=world, dp=job.dp_for(len(members) // replicas), tp=job.tp,
        store_host=first.host, store_port=first.store_port,
        restore=ckpt.path if ckpt and not memory else None, restore_step=step,
        train=train, tier0=memory.to_record() if memory else None,
        command=list(job.command), env=dict(job.env), cwd=job.cwd, restarts=restarts,
        max_restarts=job.max_restarts, replicas=replicas,
        replica_rounds=[n] * replicas if replicas > 1 else [],
        replica_epoch=n if replicas > 1 else 0)
    status = dataclasses.replace(st, state=RENDEZVOUS, round=n, members=members, since=now,
                                 reason=reason, restarts=restarts,
                                 restore=memory.label if memory else record.restore,
                                 restore_step=record.restore_step)
    where = ("from memory (tier 0)" if memory else "from storage (tier 1)") if step else ""
    # A script of the user's own: its parallelism is its own business, and with no copy
    # the daemon knows of, it resumes from its own checkpoints (or starts, the first time).
    shape = (f" ({replicas} replicas x dp {record.dp} x tp {record.tp})" if replicas > 1
             else f" (dp {record.dp} x tp {record.tp})" if job.builtin else "")
    start = ("from scratch" if job.builtin
             else "the script resumes from its own checkpoints, if any")
    msg = (f"round {n}: {len(members)} node(s) {', '.join(members)}, world {record.world_size}"
           f"{shape}, " + (f"restoring step {step} {where}" if step else start) + f" -- {reason}")
    fields = {"members": members, "restore_step": record.restore_step}
    if step:
        fields["restore_tier"] = 0 if memory else 1
    return Decision([*refused, StartRound(record), SetStatus(status),
                     Emit("round_started", msg, fields)], msg)


def _stale_holdings(now: float, view: ClusterView, st: RunStatus) -> list[str]:
    """Members of a failed round whose in-memory copies are known only from before the fault
    (their agents report within a second of it); waited for at most tier0.FRESH_WAIT_S."""
    inc = st.incident
    if st.state != RECOVERING or not isinstance(inc, dict) or now - st.since >= tier0.FRESH_WAIT_S:
        return []
    fault_at = inc.get("fault_at")
    if isinstance(fault_at, bool) or not isinstance(fault_at, (int, float)):
        return []
    return tier0.stale({n: (s.updated_at, bool(s.tier0)) for n, s in view.node_status.items()
                        if n in st.members and n in view.nodes}, float(fault_at))


def free_spares(view: ClusterView, job: JobSpec, st: RunStatus) -> list[str]:
    """Idle usable nodes outside the run, less one for each drain already waiting for its
    checkpoint: each of those has a spare promised."""
    current = set(st.members)
    spares = [n for n in usable(view, job) if n not in current]
    return spares[len([n for n in view.drains if n in current]):]
