"""One round of a rank of the built-in trainer in a job of replica groups (docs/replicas.md).

The rank's default process group is its replica's own world (lazarus.trainer.worker). Each
step reads: quorum -> heal a joiner -> data window -> lr -> micro-steps inside the replica ->
gradient average over the quorum's replicas (retried without one that broke it) -> the norm
of the averaged gradient -> guard -> clip -> step -> log. After the average every replica
holds the same gradient, so every replica's guard sees the same numbers and all reach the
same verdict.

A restarted replica's ranks start from nothing and heal at their first quorum from a live
replica's ranks: the model, the optimizer, and the state of the step before (the step, the
data position, the guard's history). There are no tier-0 snapshots and no checkpoints in this
mode yet: the daemon refuses a replica job with a checkpoint dir (lazarus.core.jobspec).
"""

from __future__ import annotations

import time

import torch

from lazarus.core.errors import JobRefused
from lazarus.trainer.replicagroup import ReplicaGroup, ReplicaPlace
from lazarus.trainer.replicapolicy import divisor, shares
from lazarus.trainer.replicastep import average_over_quorum
from lazarus.trainer.train import (RankRound, StepResult, accumulate, agreed, finish_step,
                                   lr_scale_span, total_grad_norm)

# The batch policy while a replica is missing (lazarus.trainer.replicapolicy): its share is
# left out of the step. "respread" is decided there but not wired here.
POLICY = "drop"
# A replica leader silent this long is gone. A rank on its way out says so at once
# (ReplicaPlace.leave); this is for one that cannot: its node or its agent went with it.
QUORUM_WAIT_S = 5.0


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
        # Made once the model is: a joiner asks in only when it can take the state at once.
        self.rg = self.place.group = ReplicaGroup(
            self.place.store, replica=self.place.replica, replicas=self.place.replicas,
            joining=self.place.joining, wait_s=QUORUM_WAIT_S)

    def _data_place(self, mesh) -> tuple[int, int]:
        # The job's global batch is over every replica: replica r reads share r of it.
        dp = self.cfg.parallelism.dp
        return self.place.replica * dp + mesh["dp"].get_local_rank(), self.place.replicas * dp

    def _open_savers(self, snapshot_dir: str | None) -> None:
        if self.cfg.checkpoint.dir is not None:
            raise JobRefused("checkpoints are not built in replica mode yet "
                             "(failure_unit = \"replica\"): remove [train.checkpoint] dir")
        self.checkpointer = self.snapshots = None

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
        healed = rg.heal(self.model, self.optimizer, self.resumable)
        if healed is not None:
            self._healed(healed, q.step, q.source)
        step = self.step = ctx.step = q.step

        self._enter("data")
        window, lr = self._window_and_lr(step)
        ctx.window, ctx.batch = window, self.loader.next_step()
        self._enter("forward")
        loss_t = accumulate(self.model, ctx.batch, device=self.device, loss_group=self.dp_group)
        self._enter("collective", op="all_reduce")
        # The replica's mean loss travels with its gradient: the sum over the quorum, divided
        # by the shares computed, is the step's mean loss.
        loss_box = loss_t.reshape(1).clone()
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
                     more={"replicas_in_step": members, "replica_policy": POLICY},
                     suffix=f" | replicas {members}/{replicas}" if members < replicas else "")
        self.judged = step
        self.resumable = self._resumable(step)

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
