"""One round of a rank of the built-in trainer in a job of replica groups (docs/replicas.md).

The rank's default process group is its replica's own world (lazarus.trainer.worker). Each
step reads: quorum -> heal a joiner -> data window -> lr -> micro-steps inside the replica ->
gradient average over the quorum's replicas (retried without one that broke it) -> the norm
of the averaged gradient -> guard -> clip -> step -> log. After the average every replica
holds the same gradient, so every replica's guard sees the same numbers and all reach the
same verdict.

A restarted replica's ranks start from nothing and heal at their first quorum from a live
replica's ranks: the model, the optimizer, and the state of the step before (the step, the
data position, the guard's history). A whole-world round restores every replica from the
same checkpoint on storage (RankRound.restore, each into its own world). At a checkpoint step
one replica saves: the lowest of the step's quorum (`saver_of`), with the checkpointer of the
whole-world mode over its own world; the others go on. There are no tier-0 snapshots in this
mode: a live replica is already a copy in memory (docs/replicas.md, "Checkpoints").
"""

from __future__ import annotations

import time

import torch

from lazarus.trainer.replicagroup import ReplicaGroup, ReplicaPlace
from lazarus.trainer.replicapolicy import divisor, shares
from lazarus.trainer.replicastep import average_over_quorum
from lazarus.trainer.train import (RankRound, StepResult, _checkpoint_now, _log_stalls,
                                   accumulate, agreed, finish_step, lr_scale_span,
                                   total_grad_norm)

# The batch policy while a replica is missing (lazarus.trainer.replicapolicy): its share is
# left out of the step. "respread" is decided there but not wired here.
POLICY = "drop"
# A replica leader silent this long is gone. A rank on its way out says so at once
# (ReplicaPlace.leave); this is for one that cannot: its node or its agent went with it.
QUORUM_WAIT_S = 5.0


def saver_of(members: tuple[int, ...]) -> int:
    """The replica that saves a checkpoint step: the lowest of the step's quorum. Every member
    holds the same state after the averaged step, and every rank of every member holds the
    same quorum, so all agree on it without a word."""
    return min(members)


class ReplicaRound(RankRound):
    def __init__(self, cfg, *, place: ReplicaPlace, **kwargs):
        super().__init__(cfg, **kwargs)
        self.place = place
        self.per = torch.distributed.get_world_size()
        self.job_rank = place.replica * self.per + self.rank
        self.resumable: dict | None = None  # the state of the last step done, for a joiner

    def build(self, *, restoring: bool) -> None:
        # A joiner's model is overwritten by its heal: not initialised first.
        super().build(restoring=restoring or self.place.joining)
        if self.place.joining:
            self._warm_up()
        # Made once the model is: a joiner asks in only when it can take the state at once.
        self.rg = self.place.group = ReplicaGroup(
            self.place.store, replica=self.place.replica, replicas=self.place.replicas,
            joining=self.place.joining, wait_s=QUORUM_WAIT_S, shard_store=self.place.shard_store)

    def _warm_up(self) -> None:
        """A fresh process's first optimizer step takes its lazy set-up (0.27 s of a 0.01 s
        step here, tiny model), which the live replicas would wait out in the joiner's first
        averaged step: the joiner takes it on throwaway zero gradients before it asks in.
        Its heal then overwrites the parameters and every parameter's optimizer state."""
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        finish_step(self.model, self.optimizer, total_grad_norm(self.model),
                    grad_clip=self.cfg.optimizer.grad_clip, apply=True)
        self.optimizer.state.clear()

    def _data_place(self, mesh) -> tuple[int, int]:
        # The job's global batch is over every replica: replica r reads share r of it.
        dp = self.cfg.parallelism.dp
        return self.place.replica * dp + mesh["dp"].get_local_rank(), self.place.replicas * dp

    def _open_savers(self, snapshot_dir: str | None) -> None:
        """Every replica opens the checkpointer over its own world (any of them may be the
        lowest of a later quorum); none takes tier-0 snapshots, whatever `snapshot_dir` says:
        a live replica is already a copy in memory (docs/replicas.md, "Checkpoints")."""
        super()._open_savers(None)

    def _one_step(self) -> None:
        cfg, ctx, rg = self.cfg, self.ctx, self.rg
        opt, data = cfg.optimizer, cfg.data
        replicas = self.place.replicas
        t0 = time.perf_counter()
        self.clock.start()
        if self.resumable is None:
            self.resumable = self._resumable(self.step)
        ctx.step, ctx.window, ctx.batch = self.step + 1, None, None

        # Waiting for the other replicas is waiting on peers, as in a collective.
        self._enter("collective", op="quorum")
        q = rg.next_quorum(self.step + 1)  # a joiner's tells it which step it computes
        # when the step's members were known, from its start: a replica back in the group is
        # back from then (the heal and its first step come after)
        quorum_s = time.perf_counter() - t0
        healed = rg.heal(self.model, self.optimizer, self.resumable)
        if healed is not None:
            self._healed(healed, q.step, q.source)
        step = self.step = ctx.step = q.step
        # Agreed inside this replica (a daemon's request is per agent, one per node): the
        # cross-replica average below then gives every rank of every member the same answer.
        wanted = self.checkpointer is not None and _checkpoint_now(self.session, step, cfg,
                                                                     self.device)

        self._enter("data")
        window, lr = self._window_and_lr(step)
        ctx.window, ctx.batch = window, self.loader.next_step()
        self._enter("forward")
        loss_t = accumulate(self.model, ctx.batch, device=self.device, loss_group=self.dp_group)
        self._enter("collective", op="all_reduce")
        # The replica's mean loss travels with its gradient: the sum over the quorum, divided
        # by the shares computed, is the step's mean loss. So does whether this rank wants a
        # checkpoint (a daemon's request reaches the agents at different times): above 0 once
        # averaged if any member's does.
        loss_box = torch.stack([loss_t.detach().reshape(()), loss_t.new_tensor(float(wanted))])
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        q = average_over_quorum(rg, q, grads + [loss_box], self.model, self.optimizer,
                                policy=POLICY, extra=self.resumable)
        norm_t = total_grad_norm(self.model)  # of the averaged gradient: the step's
        loss, grad_norm = agreed(loss_box[0], norm_t)
        self._enter("optimizer")
        reason = self.guard.observe(loss, grad_norm)
        finish_step(self.model, self.optimizer, norm_t, grad_clip=opt.grad_clip,
                    apply=reason is None)

        computed = divisor(shares(q.members, replicas, POLICY))
        result = StepResult(step=step, loss=loss, grad_norm=grad_norm, lr=lr,
                            tokens=data.global_batch * data.seq_len * computed // replicas,
                            step_time_s=time.perf_counter() - t0)
        members = len(q.members)
        self.stats.ranks = self.per * members  # the step's MFU is per rank that computed
        self._report(result, reason, window, compute_s=self.clock.stop(),
                     more={"replicas_in_step": members, "replica_policy": POLICY,
                           "quorum_s": round(quorum_s, 3)},
                     suffix=f" | replicas {members}/{replicas}" if members < replicas else "")
        self.judged = step
        self.resumable = self._resumable(step)
        if self.checkpointer is not None:
            self._save_replica(step, q.members, wanted=bool(loss_box[1].item() > 0))

    def _save_replica(self, step: int, members: tuple[int, ...], *, wanted: bool) -> None:
        """The step's checkpoint, when due, by the lowest replica of its quorum alone (collective
        inside that replica's world; the save's own group, never the cross-replica one). The
        others go on: an async save holds the saver for its copy off the tensors, which the
        others wait for in the next step's average, as for any slower member."""
        if wanted and saver_of(members) == self.place.replica:
            self._checkpoint(step, self.resumable)
        _log_stalls(self.metrics, self.checkpointer)

    def _healed(self, extra: dict, step: int, source: int | None) -> None:
        """This rank took its state from replica `source`'s at the start of `step`: go on
        from the step before it, where that replica was."""
        if int(extra["step"]) != step - 1:
            raise RuntimeError(f"replica {self.place.replica} healed the state of step "
                               f"{extra['step']} for step {step}")
        self.step = self.restored_step = self.judged = int(extra["step"])
        self.loader.load_state_dict(extra["loader"])
        self.guard.load_state_dict(extra["guard"])
        self.lr_scaled = lr_scale_span(self.cfg.optimizer, self.step, extra)
        self.extra, self.restored, self.source = extra, True, "replica"
        if self.rank == 0:
            print(f"replica {self.place.replica}: healed from replica {source} at step "
                  f"{self.step}", flush=True)
