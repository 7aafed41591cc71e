"""The training loop of one rank: build the sharded model, restore, and step.

Each step reads top to bottom: data window -> lr -> micro-steps -> guard -> clip -> step ->
log -> checkpoint. The process group is already initialised by the caller
(lazarus.trainer.worker). At each phase boundary the rank reports the phase to its agent and
calls the phase hooks (lazarus.trainer.hooks): the one seam for code outside the trainer.

A step whose batch the guard rejects (trainer/guard.py) updates nothing; its metrics line
(and session report) carries ``"skipped": true`` and a ``"spike"`` record::

    {"step": 12, "loss": 9.81, ..., "skipped": true,
     "spike": {"reason": "loss_spike", "loss": 9.81, "grad_norm": 41.2,
               "window": [88, 95]}}       # data cursors of the rejected batch (inclusive)

`window` is what a rollback puts in `skip_windows` to leave that data out for good.

A step's `step_time_s` ends before its checkpoint; what each save held the loop, and how long
until it was durable, is a line of its own (`"kind": "checkpoint"`, lazarus.core.stall).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lazarus.core import jobpaths
from lazarus.core.batching import plan_batches
from lazarus.core.errors import JobRefused
from lazarus.core.trainconfig import OptimizerConfig, TrainConfig
from lazarus.trainer import exchange, kept, meshes
from lazarus.trainer import snapshot as tier0
from lazarus.trainer.ckptdir import check_shared, claim
from lazarus.trainer.ckptload import load_checkpoint
from lazarus.trainer.ckptsave import Checkpointer
from lazarus.trainer.collprogress import Completed, issued
from lazarus.trainer.devstats import DeviceStats, make_deterministic
from lazarus.trainer.corpus import ensure_corpus, is_corpus
from lazarus.trainer.data import SequenceLoader, TokenDataset, check_model_vocab
from lazarus.trainer.guard import Guard
from lazarus.trainer.hooks import PhaseHooks, StepContext
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import ScheduleConfig, build_optimizer, lr_at, set_lr
from lazarus.trainer.device import device_type
from lazarus.trainer.parallelize import (activation_budget, build_mesh, build_model,
                                         gradient_sync_for)
from lazarus.trainer.rankprocess import RankProcess, this_process
from lazarus.trainer.replicagroup import ReplicaPlace
from lazarus.trainer.rngstate import rng_state, set_rng_state
from lazarus.trainer.session import Session
from lazarus.trainer.steptime import ComputeClock
from lazarus.trainer.windows import DataWindows


@dataclass(kw_only=True, slots=True)
class StepResult:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time_s: float

    def line(self, total_steps: int) -> str:
        return (f"step {self.step:>5}/{total_steps} | loss {self.loss:.4f} | grad_norm {self.grad_norm:.3f}"
                f" | lr {self.lr:.2e} | {self.tokens / self.step_time_s:,.0f} tok/s | {self.step_time_s:.3f} s")


def train_step(model: Transformer, optimizer: torch.optim.Optimizer,
               micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, device: torch.device,
               grad_clip: float, loss_group: dist.ProcessGroup | None) -> tuple[float, float, bool]:
    """One optimizer step over this rank's micro-batches: (mean loss, grad norm, applied).

    Without a guard: only a non-finite loss or gradient norm skips the update.
    """
    loss, grad_norm = forward_backward(model, micro_batches, device=device, loss_group=loss_group)
    applied = bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
    finish_step(model, optimizer, grad_norm, grad_clip=grad_clip, apply=applied)
    return loss.item(), grad_norm.item(), applied


def forward_backward(model: Transformer, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                     device: torch.device, loss_group: dist.ProcessGroup | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of this rank's micro-batches; returns (loss, grad norm) of the global batch.

    The loss is averaged over the data-parallel group, so every rank holds the loss of the
    whole global batch; the norm is that of the whole model's gradient.
    """
    loss = accumulate(model, micro_batches, device=device, loss_group=loss_group)
    return loss, total_grad_norm(model)


def accumulate(model: Transformer, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *,
               device: torch.device, loss_group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's micro-batches' gradients, accumulated; the loss averaged over `loss_group`."""
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Reduce-scatter gradients after the last micro-batch only, or after each on GPUs
        # (lazarus.trainer.parallelize.sync_every_micro_batch: memory).
        model.set_requires_gradient_sync(gradient_sync_for(i, len(micro_batches),
                                                           every=model.sync_every_micro_batch))
        logits = model(inputs.to(device))
        loss = model.loss(logits, targets.to(device)) / len(micro_batches)
        del logits  # not held through the backward: [B, T, vocab] is the largest activation
        loss.backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum, group=loss_group)  # gloo has no AVG
    loss_sum /= dist.get_world_size(loss_group)
    return loss_sum


def total_grad_norm(model: Transformer) -> torch.Tensor:
    """The norm of the whole model's gradient, on every rank of its mesh."""
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None],
                                              foreach=True)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    return grad_norm


def finish_step(model: Transformer, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, *,
                grad_clip: float, apply: bool) -> None:
    """Clip and step if `apply`; drop the gradients either way."""
    if apply:
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm, foreach=True)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def take_snapshot(snapshots: tier0.Snapshotter, held: kept.Held, step: int, model: Transformer,
                  optimizer: torch.optim.Optimizer, resumable: dict, *,
                  checkpoint: bool = False) -> None:
    """The step's tier-0 snapshot, if due (always on a `checkpoint` step). The kept objects'
    capture follows the snapshotter's even when the take fails (a peer gone in its
    collective): the buffers are overwritten by then, and a capture still named for the older
    step would restore the newer tensors."""
    if not snapshots.due(step, checkpoint=checkpoint):
        return
    try:
        snapshots.take(step, model, optimizer, resumable)
    finally:
        held.captured = snapshots.last


def agreed(loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
    """Rank 0's (loss, grad norm) on every rank. The values are global already; taking one
    rank's copy makes every rank's guard see the same numbers, so all hold the same history
    and reach the same verdict by construction, not by bit-identical reductions."""
    stats = torch.stack([loss.double(), grad_norm.double()])
    dist.broadcast(stats, src=0)
    loss_value, norm_value = stats.tolist()
    return loss_value, norm_value


# How a round's state is restored (choose_restore), cheapest first.
KEPT = "kept"            # the objects this survivor kept hold the very step: nothing to load
CAPTURED = "captured"    # its own last snapshot of that step, still in its host buffers
SNAPSHOT = "snapshot"    # a tier-0 snapshot file of this rank (its own or its peer's copy)
CHECKPOINT = "checkpoint"  # a committed checkpoint on storage (tier 1)
SCRATCH = "scratch"      # nothing: the first round of a run


@dataclass(frozen=True, slots=True)
class RestorePlan:
    how: str     # one of the above
    source: str  # what the start line and its metrics row call it: kept, memory, storage, scratch


def choose_restore(*, restore_step: int, snapshot: str | None, checkpoint: str | None,
                   kept_step: int, captured_step: int | None) -> RestorePlan:
    """Where this rank's state for a round comes from. The round names what to restore
    (`snapshot`: a tier-0 file; `checkpoint`: a committed checkpoint; neither: from scratch)
    and its step (`restore_step`); a rank that went on in its own process (lazarus.trainer
    .inplace) may already hold that step in its kept objects (`kept_step`: the last step they
    finished; 0: none) or in its last snapshot's buffers (`captured_step`)."""
    if snapshot is None and checkpoint is None:
        return RestorePlan(SCRATCH, "scratch")
    if restore_step >= 1 and kept_step == restore_step:
        return RestorePlan(KEPT, "kept")
    if captured_step is not None and captured_step == restore_step:
        return RestorePlan(CAPTURED, "memory")
    if snapshot is not None:
        return RestorePlan(SNAPSHOT, "memory")
    return RestorePlan(CHECKPOINT, "storage")


def train(cfg: TrainConfig, *, session: Session, process: RankProcess | None = None,
          restore: str | None = None, hooks: PhaseHooks | None = None, job_id: str = "",
          snapshot: str | None = None, snapshot_dir: str | None = None, round_: int = 0,
          allowed_roots: list[str] | tuple[str, ...] = (), began: float | None = None,
          handed: float | None = None, in_place: bool = False, restore_step: int = 0,
          replica: ReplicaPlace | None = None) -> None:
    """Train to cfg.steps. `restore` is a committed checkpoint to continue from, `snapshot` a
    tier-0 snapshot file of this rank to continue from instead; `hooks` are called at every
    phase boundary (lazarus.trainer.hooks); `job_id` owns the checkpoints this run writes
    (lazarus.trainer.ckptdir.claim). `snapshot_dir`: where tier-0 snapshots go (the
    agent's; None: no tier 0). `allowed_roots`: where the job's paths must lie
    (lazarus.core.jobpaths; empty: anywhere). JobRefused when a path is outside them, when
    the checkpoint dir is another job's, or, starting afresh, is not shared. `began`: when
    the agent handed this rank its assignment, `handed`: when the rank took it
    (time.perf_counter()): the start line times from them. `process`: what this process
    carries between rounds (default: this process's); `in_place`: this process ran an
    earlier round (lazarus.trainer.inplace); the start line says so, and the model and
    optimizer it kept are used again when they fit the round (lazarus.trainer.kept).
    `restore_step`: the step the round restores, whichever tier."""
    start = StartTimes(began=time.perf_counter() if began is None else began, handed=handed)
    if in_place:
        start.survived(process or this_process())
    # A corpus is only read where it exists; a data.dir without one is built, so written.
    corpus = cfg.data.dir if cfg.data.dir and not is_corpus(Path(cfg.data.dir)) else None
    if why := jobpaths.outside({"checkpoint.dir": cfg.checkpoint.dir, "metrics": cfg.metrics,
                                "data.dir": corpus}, allowed_roots):
        raise JobRefused(why)
    # A job of replica groups steps its own way (ReplicaRound), chosen once here: the
    # default path's loop has nothing of it.
    if replica is None:
        kind, more = RankRound, {}
    else:
        # here: it subclasses RankRound, defined below
        from lazarus.trainer.replicaloop import ReplicaRound
        kind, more = ReplicaRound, {"place": replica}
    rnd = kind(cfg, session=session, process=process or this_process(),
               hooks=hooks or PhaseHooks(), job_id=job_id, round_=round_, start=start,
               in_place=in_place, **more)
    rnd.build(restoring=restore is not None or snapshot is not None)
    rnd.restore(restore_step=restore_step, snapshot=snapshot, checkpoint=restore)
    rnd.run(snapshot_dir)


class RankRound:
    """One round of this rank of the built-in trainer: built (or taken from what the process
    kept), restored as `choose_restore` says, then stepped to cfg.steps."""

    def __init__(self, cfg: TrainConfig, *, session: Session, process: RankProcess,
                 hooks: PhaseHooks, job_id: str, round_: int, start: StartTimes,
                 in_place: bool):
        self.cfg, self.session, self.process, self.hooks = cfg, session, process, hooks
        self.job_id, self.round, self.start, self.in_place = job_id, round_, start, in_place
        self.rank = dist.get_rank()
        self.job_rank = self.rank  # the rank in the whole job: its 0 writes the metrics
        kind = device_type()
        self.device = (torch.device(kind, torch.cuda.current_device()) if kind == "cuda"
                       else torch.device("cpu"))
        self.step = 0
        self.extra: dict = {}
        self.restored = False    # the round continued from a step rather than from scratch
        self.source = "scratch"
        self.capture = None      # the kept snapshot buffers this round's snapshots reuse
        self.skipped_steps: list[int] = []  # rejected steps: they make a checkpoint bad
        self.judged = 0          # the last step whose guard verdict is in

    def build(self, *, restoring: bool) -> None:
        """The model, optimizer and data of this round: the process's kept objects when they
        fit (`restoring` a step), else new ones."""
        cfg, rank = self.cfg, self.rank
        par, data = cfg.parallelism, cfg.data
        kind = self.device.type
        shape = kept.shape_of(cfg, job_id=self.job_id, rank=rank,
                              world_size=dist.get_world_size(), device=kind)
        held = kept.take(self.process, shape, restoring=restoring)
        self.mesh = mesh = build_mesh(kind, dp=par.dp, tp=par.tp)
        # Before any DTensor op: the caches this process inherited or kept, and the meshes of
        # the objects it kept, are this world's now.
        self.warm = meshes.adopt(mesh)
        torch.manual_seed(cfg.seed)
        if cfg.deterministic:
            make_deterministic()

        self.model_cfg = get_model_config(cfg.model.name)
        self.reused = held is not None
        if held is not None:
            self.model, self.optimizer = held.model, held.optimizer
            kept.reuse(held)
        else:
            self.model = build_model(self.model_cfg, mesh, par, seed=cfg.seed,
                                     fused_kernels=cfg.model.fused_kernels, init=not restoring)
            self.optimizer = build_optimizer(self.model, lr=cfg.optimizer.lr,
                                             weight_decay=cfg.optimizer.weight_decay)
            held = kept.Held(shape, self.model, self.optimizer)
        self.held = self.process.held = held
        dp_rank, dp_size = self._data_place(mesh)
        # Collective: every rank takes the smallest budget, so all choose the same micro-batch.
        if kind == "cuda":
            self.start.entering()  # activation_budget all-reduces on CUDA only
        plan = plan_batches(data.global_batch, dp_size, data.micro_batch,
                            memory=activation_budget(self.model, par, seq_len=data.seq_len))
        if plan.warning and rank == 0:
            print(f"warning: {plan.warning}", flush=True)
        dataset = TokenDataset(ensure_corpus(Path(data.dir) if data.dir else None), data.seq_len)
        check_model_vocab(dataset, self.model_cfg.vocab_size, cfg.model.name)
        self.loader = SequenceLoader(dataset, seed=cfg.seed, global_batch=data.global_batch,
                                     dp_rank=dp_rank, dp_size=dp_size,
                                     micro_batch=plan.micro_batch)
        opt = cfg.optimizer
        self.schedule = ScheduleConfig(schedule=opt.schedule, lr=opt.lr, min_lr=opt.min_lr,
                                       warmup_steps=opt.warmup_steps, total_steps=cfg.steps,
                                       decay_fraction=opt.wsd_decay_fraction)
        self.guard = Guard(cfg.guard)
        self.start.mark("build")

    def _data_place(self, mesh) -> tuple[int, int]:
        """(this rank's share, shares) of each global batch."""
        return mesh["dp"].get_local_rank(), self.cfg.parallelism.dp

    def restore(self, *, restore_step: int, snapshot: str | None,
                checkpoint: str | None) -> None:
        """This round's state, from where `choose_restore` says."""
        held, model, optimizer, rank = self.held, self.model, self.optimizer, self.rank
        captured, held.captured = held.captured, None
        plan = choose_restore(restore_step=restore_step, snapshot=snapshot,
                              checkpoint=checkpoint, kept_step=held.step,
                              captured_step=captured.step if captured is not None else None)
        if captured is not None and captured.step == restore_step and plan.how != SCRATCH:
            self.capture = captured
        self.source = plan.source
        extra: dict = {}
        if plan.how == KEPT:
            extra = dict(held.extra)
            set_rng_state(held.rng)
            label = f"its own state at step {held.step}, kept in place"
        elif plan.how == CAPTURED:
            extra = tier0.restore_captured(captured.header, captured.tensors, captured.values,
                                           model, optimizer,
                                           what=f"its own snapshot of step {restore_step}")["extra"]
            label = f"its own snapshot of step {restore_step}, in memory"
        elif plan.how == SNAPSHOT:
            extra = tier0.restore(tier0.load_file(snapshot), model, optimizer, rank=rank,
                                  world_size=dist.get_world_size(), what=snapshot)["extra"]
            label = f"memory (tier 0) {snapshot}"
        elif plan.how == CHECKPOINT:
            extra = load_checkpoint(Path(checkpoint), model, optimizer)
            label = checkpoint
        if plan.how != SCRATCH:
            self.restored = True
            self.step = int(extra["step"])
            self.loader.load_state_dict(extra["loader"])
            if "guard" in extra:  # checkpoints written before the guard existed have none
                self.guard.load_state_dict(extra["guard"])
            if rank == 0:
                print(f"resumed from {label} at step {self.step}", flush=True)
            held.mark(self.step, extra, rng_state())
        self.extra = extra
        self.start.mark("restore")

    def is_good(self, ckpt_step: int) -> bool:
        """Good = committed, and no spike in the steps after it (docs/architecture.md,
        "Checkpoints"), here seen to the end of that span: a checkpoint too recent to judge
        is not good yet. The one this process restored from was judged good by whoever
        chose it. (Retention asks from the background.)"""
        if ckpt_step == self.restored_step and self.restored:
            return True
        span = self.cfg.checkpoint.good_after_steps
        return (ckpt_step + span <= self.judged
                and not any(ckpt_step < s <= ckpt_step + span for s in self.skipped_steps))

    def _open_savers(self, snapshot_dir: str | None) -> None:
        """The checkpointer and the tier-0 snapshotter of this round, after rank 0 claimed
        the checkpoint dir for the job."""
        ck, rank, session = self.cfg.checkpoint, self.rank, self.session
        if ck.dir is not None:
            # Rank 0 claims the directory; every rank learns the verdict and stops together.
            self.start.entering()
            verdict = exchange.broadcast(
                claim(Path(ck.dir), self.job_id, adopt=ck.resume is not None)
                if rank == 0 else None, src=0)
            if verdict is not None:
                raise JobRefused(verdict)
            # Later rounds learn of a node that cannot see the dir at their restore, and the
            # daemon cordons it (lazarus.daemon.restorefail); the job itself is wrong only here.
            if not self.restored and (why := check_shared(Path(ck.dir))):
                raise JobRefused(why)
        self.checkpointer = (Checkpointer(Path(ck.dir), keep_last=ck.keep_last,
                                          is_good=self.is_good, job_id=self.job_id)
                             if ck.dir is not None else None)
        par = self.cfg.parallelism
        self.snapshots = (tier0.Snapshotter(
            Path(snapshot_dir), every=ck.memory_every, first_step=self.step,
            header={"job": self.job_id, "round": self.round, "rank": rank,
                    "world_size": dist.get_world_size(), "mesh": [par.dp, par.tp]},
            on_written=session.snapshot_written, kept=session.snapshots_kept,
            buffers=self.capture.tensors if self.capture is not None else None)
            if snapshot_dir is not None and ck.memory_every >= 0 and session.connected
            else None)

    def run(self, snapshot_dir: str | None) -> None:
        """Step to cfg.steps; the savers are closed however it ends."""
        cfg = self.cfg
        self.restored_step = self.judged = self.step
        self.windows = DataWindows(self.loader, skip=cfg.data.skip_windows)
        self.lr_scaled = lr_scale_span(cfg.optimizer, self.step, self.extra)
        self.groups = [dist.group.WORLD] + [self.mesh.get_group(d)
                                            for d in self.mesh.mesh_dim_names]
        self.completed = Completed(self.device)
        self.checkpointer = self.snapshots = None
        self.metrics = None
        finished = False
        try:
            self._open_savers(snapshot_dir)
            self.metrics = (open(cfg.metrics, "a", encoding="utf-8")
                            if self.job_rank == 0 and cfg.metrics else None)
            self.dp_group = self.mesh["dp"].get_group()
            self.clock = ComputeClock(self.device)
            self.stats = DeviceStats(self.device, self.model_cfg, seq_len=cfg.data.seq_len,
                                     ranks=dist.get_world_size(), peak=cfg.peak_tflops)
            checkpointer = self.checkpointer
            self.ctx = StepContext(cfg=cfg, rank=self.rank, loader=self.loader,
                                   clock=self.clock,
                                   settle=checkpointer.wait if checkpointer is not None
                                   else lambda: None)
            self.start.mark("setup")
            while self.step < cfg.steps:
                self._one_step()
            finished = True
            self.process.held = None
        finally:
            self._close(finished)

    def _collectives(self) -> int:
        # Collectives this rank has done: equal on every rank at the same point of the
        # program, so the agent can tell which rank the others wait for. On CUDA, those its
        # device has passed, not those the host enqueued (lazarus.trainer.collprogress).
        return self.completed.count(issued(self.groups))

    def _enter(self, phase: str, **op) -> None:
        self.session.progress(self.step, phase, self._collectives(), **op)
        self.hooks(phase, self.ctx)

    def _one_step(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        opt, data = cfg.optimizer, cfg.data
        self.step += 1
        step = self.step
        t0 = time.perf_counter()
        self.clock.start()
        ctx.step, ctx.window, ctx.batch = step, None, None

        self._enter("data")
        window, lr = self._window_and_lr(step)
        ctx.window, ctx.batch = window, self.loader.next_step()
        self._enter("forward")
        loss_t, norm_t = forward_backward(self.model, ctx.batch, device=self.device,
                                          loss_group=self.dp_group)
        self._enter("collective", op="all_reduce")
        loss, grad_norm = agreed(loss_t, norm_t)
        self._enter("optimizer")
        reason = self.guard.observe(loss, grad_norm)
        finish_step(self.model, self.optimizer, norm_t, grad_clip=opt.grad_clip,
                    apply=reason is None)

        result = StepResult(step=step, loss=loss, grad_norm=grad_norm, lr=lr,
                            tokens=data.global_batch * data.seq_len,
                            step_time_s=time.perf_counter() - t0)
        self._report(result, reason, window, compute_s=self.clock.stop())
        self.judged = step

        resumable = self._resumable(step)

        # This rank's part of the step is done: a survivor of a later failure may go on
        # from here in its own objects (lazarus.trainer.kept).
        self.held.mark(step, resumable, rng_state())
        self._save(step, result, resumable)

    def _window_and_lr(self, step: int) -> tuple[dict, float]:
        """The data window `step` reads (past those left out) and its lr, set."""
        window, left_out = self.windows.next_window()
        if self.rank == 0:
            for w in left_out:
                print(f"data window [{w['first']}, {w['last']}] left out (skip_windows)", flush=True)
        lr = lr_at(step, self.schedule)
        if self.lr_scaled is not None and self.lr_scaled[0] <= step <= self.lr_scaled[1]:
            lr *= self.cfg.optimizer.lr_scale
        set_lr(self.optimizer, lr)
        return window, lr

    def _resumable(self, step: int) -> dict:
        """What a restore needs besides the tensors, once per step: every saver takes this
        one (none changes it)."""
        opt, lr_scaled = self.cfg.optimizer, self.lr_scaled
        return {"step": step, "loader": self.loader.state_dict(),
                "schedule": _fields(self.schedule), "global_batch": self.cfg.data.global_batch,
                "guard": self.guard.state_dict(),
                **({"lr_scale": {"scale": opt.lr_scale, "first": lr_scaled[0],
                                 "last": lr_scaled[1]}} if lr_scaled else {})}

    def _report(self, result: StepResult, reason: str | None, window: dict, *,
                compute_s: float, more: dict | None = None, suffix: str = "") -> None:
        """The step's start line (the round's first), metrics line and report; `more`: fields
        of the mode the step ran in, `suffix`: its words on the step line."""
        rank, session, metrics, cfg = self.rank, self.session, self.metrics, self.cfg
        cost = self.stats.fields(tokens=result.tokens, step_time_s=result.step_time_s)
        if not self.start.done:
            self.start.mark("first_step")
            row = self.start.row(round_=self.round, step=result.step - 1, source=self.source,
                                 in_place=self.in_place, warm=self.warm, kept=self.reused)
            print(self.start.line(row), flush=True)
            _log(metrics, row)
        more = more or {}
        if reason is None:
            session.report(**_fields(result), skipped=False, compute_s=compute_s,
                           window=[window["first"], window["last"]], **more)
            # the wall time it was done: benchmarks put every system on one clock with it
            _log(metrics, {**_fields(result), **cost, **more, "time": round(time.time(), 3)})
            if rank == 0:
                print(result.line(cfg.steps) + DeviceStats.line(cost) + suffix, flush=True)
        else:
            self.skipped_steps.append(result.step)
            spike = {"reason": reason, "loss": result.loss, "grad_norm": result.grad_norm,
                     "window": [window["first"], window["last"]]}
            session.report(**_fields(result), skipped=True, spike=spike, compute_s=compute_s,
                           **more)
            _log(metrics, {**_fields(result), "skipped": True, "spike": spike, **more})
            if rank == 0:
                print(f"{result.line(cfg.steps)}{suffix} | skipped: {reason}, data window "
                      f"{spike['window']}", flush=True)

    def _save(self, step: int, result: StepResult, resumable: dict) -> None:
        """The step's tier-0 snapshot and checkpoint, each when due. A checkpoint step is
        snapshotted too: a restore takes memory only when it is as new as storage."""
        snapshots, checkpointer, session = self.snapshots, self.checkpointer, self.session
        checkpoint = checkpointer is not None and _checkpoint_now(session, step, self.cfg,
                                                                   self.device)
        if snapshots is not None:
            snapshots.observe_step(result.step_time_s)
            take_snapshot(snapshots, self.held, step, self.model, self.optimizer, resumable,
                          checkpoint=checkpoint)
        if checkpoint:
            self._checkpoint(step, resumable)
        for saver in (snapshots, checkpointer):
            if saver is not None:
                _log_stalls(self.metrics, saver)

    def _checkpoint(self, step: int, resumable: dict) -> None:
        """Save `step` to storage (collective over this rank's world), committed through the
        agent."""
        session = self.session
        self._enter("checkpoint")
        self.checkpointer.save(step, self.model, self.optimizer, resumable,
                               async_save=self.cfg.checkpoint.async_save,
                               commit_gate=session.may_commit,
                               on_commit=lambda s, path: session.checkpoint_committed(s, str(path)),
                               # a full or read-only disk costs this checkpoint, not the run
                               on_fail=session.checkpoint_failed)

    def _close(self, finished: bool) -> None:
        if self.snapshots is not None:
            # A rank that stops early (a peer gone) must not wait on its agent.
            self.snapshots.close(settle_s=tier0.SETTLE_S if finished else 0.0)
            _log_stalls(self.metrics, self.snapshots)
        if self.checkpointer is not None:
            self.checkpointer.close()
            _log_stalls(self.metrics, self.checkpointer)
        if self.metrics is not None:
            self.metrics.close()


class StartTimes:
    """Where a rank's start went, from its assignment to its first step done: the part of a
    recovery inside the trainer (docs/architecture.md, "Checkpoints"). One metrics line of
    kind "start" per round, rank 0's; every rank prints its own."""

    PHASES = ("handover", "rendezvous", "build", "restore", "setup", "first_step")

    def __init__(self, *, began: float, handed: float | None = None):
        """`began`: when the agent handed the assignment over; `handed`: when this process
        took it (a parked worker busy warming up reads it late; a survivor first lets its
        last round go)."""
        self._last = began
        self._began = began
        self.seconds: dict[str, float] = {}
        # Wall-clock times this rank entered a collective of the whole world during its start:
        # there a survivor waits on a rank still starting (the scale bench takes that wait out
        # of the survivors' part: docs/scale.md).
        self.entered: list[float] = []
        self.handover_at: dict[str, float] = {}
        if handed is not None:
            self.seconds["handover"], self._last = max(0.0, handed - began), max(began, handed)
        # init_process_group ran before train(): the wait for the round's peers.
        self.mark("rendezvous")
        self.done = False

    def survived(self, process: RankProcess) -> None:
        """This rank survived the last round in its process: its hand-over splits into the
        survivor seeing a peer gone, letting that round go, and the agent's message
        (`RankProcess.noticed_at`, `left_at`, `resumed_at`)."""
        self.handover_at = {"noticed_at": process.noticed_at, "left_at": process.left_at,
                            "resumed_at": process.resumed_at}

    def entering(self) -> None:
        """This rank now enters a collective every rank of the round takes part in."""
        self.entered.append(time.time())

    def mark(self, phase: str) -> None:
        assert phase in self.PHASES, phase
        now = time.perf_counter()
        self.seconds[phase], self._last = now - self._last, now
        self.done = phase == self.PHASES[-1]

    def row(self, *, round_: int, step: int, source: str, in_place: bool = False,
            warm: set[str] = frozenset(), kept: bool = False) -> dict:
        """`source`: what the round's state came from: "scratch", "storage", "memory" (a
        tier-0 snapshot), or "kept" (the objects a survivor kept hold the very step).
        `warm`: what filled DTensor's caches before this round (lazarus.trainer.meshes:
        "rehearsal", "round"), empty for a cold start. `kept`: this survivor went on in its
        model and optimizer objects (lazarus.trainer.kept)."""
        # Wall-clock times, to line a start up with the agents' and the daemon's logs.
        done_at = time.time() - (time.perf_counter() - self._last)
        return {"kind": "start", "round": round_, "step": step, "from": source,
                "in_place": in_place, "kept": kept, "warm": sorted(warm), "pid": os.getpid(),
                "began_at": round(done_at - (self._last - self._began), 3),
                "done_at": round(done_at, 3),
                "total_s": round(self._last - self._began, 6),
                "entered_at": [round(t, 3) for t in self.entered],
                **{k: round(t, 3) for k, t in self.handover_at.items() if t > 0},
                **{f"{p}_s": round(self.seconds.get(p, 0.0), 6) for p in self.PHASES}}

    @staticmethod
    def line(row: dict) -> str:
        parts = ", ".join(f"{p.replace('_', ' ')} {row[p + '_s']:.2f} s"
                          for p in StartTimes.PHASES)
        source = "its own state" if row["from"] == "kept" else row["from"]
        return (f"round {row['round']} from {source} at step {row['step']}"
                f"{' in place' if row.get('in_place') else ''}"
                f"{', model kept' if row.get('kept') else ''}"
                f"{' rehearsed' if 'rehearsal' in row.get('warm', ()) else ''}: first step "
                f"done {row['total_s']:.2f} s after the assignment ({parts})"
                + (f"; world collectives entered at "
                   f"{', '.join(f'{t:.3f}' for t in row['entered_at'])}"
                   if row.get("entered_at") else "")
                + (f"; handed over: a peer seen gone at {row['noticed_at']:.3f}, issued at "
                   f"{row['began_at']:.3f}, the last round let go at {row['left_at']:.3f}, the "
                   f"assignment came at {row['resumed_at']:.3f}"
                   if {"noticed_at", "left_at", "resumed_at"} <= row.keys() else ""))


def lr_scale_span(opt: OptimizerConfig, start_step: int, extra: dict) -> tuple[int, int] | None:
    """The optimizer steps (first, last) that run at lr x opt.lr_scale (see OptimizerConfig).

    A checkpoint records its run's span; resuming it under the same order continues that span,
    so a restart in the middle of it changes nothing. A new order starts after `start_step`.
    """
    if opt.lr_scale_steps == 0 or opt.lr_scale == 1.0:
        return None
    recorded = extra.get("lr_scale")
    if (recorded is not None and recorded["scale"] == opt.lr_scale
            and recorded["last"] - recorded["first"] + 1 == opt.lr_scale_steps):
        return recorded["first"], recorded["last"]
    return start_step + 1, start_step + opt.lr_scale_steps


def _log(metrics, row: dict) -> None:
    if metrics is not None:
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()


def _log_stalls(metrics, saver: Checkpointer | tier0.Snapshotter) -> None:
    # A save's line goes out once the save has finished (an async one, or a snapshot on its
    # way to the peer: some steps later), when its durable_s is known; lazarus.core.stall has
    # the shape.
    for stall in saver.stalls():
        _log(metrics, stall.to_row())


def _checkpoint_now(session: Session, step: int, cfg: TrainConfig, device: torch.device) -> bool:
    """Every rank must reach the same answer: a save is collective."""
    wanted = session.should_checkpoint(step, cfg.checkpoint.every) or step == cfg.steps
    if session.connected:
        # A daemon request reaches the ranks' agents at slightly different times; take it
        # if any rank has it.
        flag = torch.tensor(int(wanted), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        wanted = bool(flag.item())
    return wanted


def _fields(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}
