"""The training loop of one rank: build the sharded model, restore, and step.

Each step reads top to bottom: data window -> lr -> micro-steps -> guard -> clip -> step ->
log -> checkpoint. The process group is already initialised by the caller
(lazarus.trainer.worker).

A step whose batch the guard rejects (trainer/guard.py) updates nothing; its metrics line
(and session report) carries ``"skipped": true`` and a ``"spike"`` record::

    {"step": 12, "loss": 9.81, ..., "skipped": true,
     "spike": {"reason": "loss_spike", "loss": 9.81, "grad_norm": 41.2,
               "window": [88, 95]}}       # data cursors of the rejected batch (inclusive)

`window` is what a rollback puts in `skip_windows` to leave that data out for good.
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

from lazarus.trainer import checkpoint as ckpt
from lazarus.trainer.batching import plan_batches
from lazarus.trainer.config import TrainConfig
from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
from lazarus.trainer.guard import Guard
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer, lr_at, set_lr
from lazarus.trainer.parallelize import ParallelConfig, build_mesh, build_model, device_type
from lazarus.trainer.session import Session
from lazarus.trainer.steptime import ComputeClock, Slowdown, Stalls
from lazarus.trainer.windows import DataWindows

# Exit code of a rank killed by fault injection (LAZARUS_FAIL_AT): tests tell it apart from a
# real failure.
FAULT_EXIT_CODE = 43


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
    loss_sum = torch.zeros((), device=device)
    for i, (inputs, targets) in enumerate(micro_batches):
        # Reduce-scatter gradients once per step, after the last micro-batch, not after each.
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        logits = model(inputs.to(device))
        loss = model.loss(logits, targets.to(device)) / len(micro_batches)
        loss.backward()
        loss_sum += loss.detach()
    dist.all_reduce(loss_sum, group=loss_group)  # gloo has no AVG
    loss_sum /= dist.get_world_size(loss_group)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None],
                                              foreach=True)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    return loss_sum, grad_norm


def finish_step(model: Transformer, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, *,
                grad_clip: float, apply: bool) -> None:
    """Clip and step if `apply`; drop the gradients either way."""
    if apply:
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm, foreach=True)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def agreed(loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
    """Rank 0's (loss, grad norm) on every rank. The values are global already; taking one
    rank's copy makes every rank's guard see the same numbers, so all hold the same history
    and reach the same verdict by construction, not by bit-identical reductions."""
    stats = torch.stack([loss.double(), grad_norm.double()])
    dist.broadcast(stats, src=0)
    loss_value, norm_value = stats.tolist()
    return loss_value, norm_value


def train(cfg: TrainConfig, *, session: Session, restore: str | None = None,
          fail_at_step: int | None = None) -> None:
    """Train to cfg.steps. `restore` is a committed checkpoint to continue from.

    `fail_at_step` (fault injection): this rank dies at the start of that step, after any
    checkpoint in flight has been committed, so a test knows which checkpoint survives.
    """
    rank = dist.get_rank()
    kind = device_type()
    device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    mesh = build_mesh(kind, dp=cfg.dp, tp=cfg.tp)
    torch.manual_seed(cfg.seed)

    model_cfg = get_model_config(cfg.model)
    model = build_model(model_cfg, mesh,
                        ParallelConfig(dp=cfg.dp, tp=cfg.tp, activation_checkpointing=cfg.activation_checkpointing,
                                       compile=cfg.compile),
                        seed=cfg.seed, fused_kernels=cfg.fused_kernels)
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    plan = plan_batches(cfg.global_batch, cfg.dp, cfg.micro_batch)
    dataset = TokenDataset(ensure_corpus(Path(cfg.data) if cfg.data else None), cfg.seq_len)
    loader = SequenceLoader(dataset, seed=cfg.seed, global_batch=cfg.global_batch,
                            dp_rank=mesh["dp"].get_local_rank(), dp_size=cfg.dp, micro_batch=plan.micro_batch)
    schedule = cfg.schedule_config()

    step = 0
    extra: dict = {}
    guard = Guard(cfg.guard_config())
    if restore is not None:
        extra = ckpt.load_checkpoint(Path(restore), model, optimizer)
        step = int(extra["step"])
        loader.load_state_dict(extra["loader"])
        if "guard" in extra:  # checkpoints written before the guard existed have none
            guard.load_state_dict(extra["guard"])
        if rank == 0:
            print(f"resumed from {restore} at step {step}", flush=True)
    windows = DataWindows(loader, skip=cfg.skip_windows, inject=cfg.inject, vocab_size=model_cfg.vocab_size)
    lr_scaled = lr_scale_span(cfg, step, extra)

    groups = [dist.group.WORLD] + [mesh.get_group(d) for d in mesh.mesh_dim_names]

    def _collectives() -> int:
        # Collectives this rank has issued: equal on every rank at the same point of the
        # program, so the agent can tell which rank the others wait for.
        return sum(g._get_sequence_number_for_group() for g in groups)

    hang_at_step = (cfg.hang_at_step if cfg.hang_at_step and rank == cfg.hang_rank
                    and not _hang_marker(cfg).exists() else None)
    skipped_steps: list[int] = []  # this process's rejected steps: they make a checkpoint bad

    restored_step = step
    judged = [step]  # the last step whose guard verdict is in: retention runs in the background

    def is_good(ckpt_step: int) -> bool:
        # DESIGN.md: good = committed, and no spike in the steps after it (here seen to the
        # end of that span: a checkpoint too recent to judge is not good yet). The one this
        # process restored from was judged good by whoever chose it.
        if ckpt_step == restored_step and restore is not None:
            return True
        return (ckpt_step + cfg.good_after_steps <= judged[0]
                and not any(ckpt_step < s <= ckpt_step + cfg.good_after_steps
                            for s in skipped_steps))

    checkpointer = (ckpt.Checkpointer(Path(cfg.ckpt_dir), keep_last=cfg.keep_last,
                                      is_good=is_good)
                    if cfg.ckpt_dir is not None else None)
    metrics = open(cfg.metrics, "a", encoding="utf-8") if rank == 0 and cfg.metrics else None
    dp_group = mesh["dp"].get_group()
    clock, slowdown = ComputeClock(device), Slowdown.from_env()
    stalls = Stalls(cfg.stalls, cfg.stall_s, Path(cfg.ckpt_dir or "."))
    try:
        while step < cfg.steps:
            step += 1
            if fail_at_step == step:
                if checkpointer is not None:
                    checkpointer.wait()
                os._exit(FAULT_EXIT_CODE)
            t0 = time.perf_counter()
            clock.start()
            slowdown.refresh()

            session.progress(step, "data", _collectives())
            window, left_out = windows.next_window()
            if rank == 0:
                for w in left_out:
                    print(f"data window [{w['first']}, {w['last']}] left out (skip_windows)", flush=True)
            lr = lr_at(step, schedule)
            if lr_scaled is not None and lr_scaled[0] <= step <= lr_scaled[1]:
                lr *= cfg.lr_scale
            set_lr(optimizer, lr)
            batch = windows.poison(window, loader.next_step())
            if hang_at_step == step:
                _hang_here(cfg, step)  # before "forward": the peers then wait on this rank
            session.progress(step, "forward", _collectives())
            stalls.maybe("step", step)
            loss_t, norm_t = forward_backward(model, batch, device=device, loss_group=dp_group)
            slowdown.apply(clock)
            session.progress(step, "collective", _collectives(), op="all_reduce")
            loss, grad_norm = agreed(loss_t, norm_t)
            session.progress(step, "optimizer", _collectives())
            reason = guard.observe(loss, grad_norm)
            finish_step(model, optimizer, norm_t, grad_clip=cfg.grad_clip, apply=reason is None)

            result = StepResult(step=step, loss=loss, grad_norm=grad_norm, lr=lr,
                                tokens=cfg.global_batch * cfg.seq_len, step_time_s=time.perf_counter() - t0)
            compute_s = clock.stop()
            if reason is None:
                session.report(**_fields(result), skipped=False, compute_s=compute_s,
                               window=[window["first"], window["last"]])
                _log(metrics, _fields(result))
                if rank == 0:
                    print(result.line(cfg.steps), flush=True)
            else:
                skipped_steps.append(step)
                spike = {"reason": reason, "loss": loss, "grad_norm": grad_norm,
                         "window": [window["first"], window["last"]]}
                session.report(**_fields(result), skipped=True, spike=spike, compute_s=compute_s)
                _log(metrics, {**_fields(result), "skipped": True, "spike": spike})
                if rank == 0:
                    print(f"{result.line(cfg.steps)} | skipped: {reason}, data window {spike['window']}",
                          flush=True)

            judged[0] = step
            if checkpointer is not None and _checkpoint_now(session, step, cfg, device):
                session.progress(step, "checkpoint", _collectives())
                stalls.maybe("checkpoint", step)
                checkpointer.save(step, model, optimizer,
                                  {"step": step, "loader": loader.state_dict(),
                                   "schedule": _fields(schedule), "global_batch": cfg.global_batch,
                                   "guard": guard.state_dict(),
                                   **({"lr_scale": {"scale": cfg.lr_scale, "first": lr_scaled[0],
                                                    "last": lr_scaled[1]}} if lr_scaled else {})},
                                  async_save=cfg.async_checkpoint, commit_gate=session.may_commit,
                                  on_commit=lambda s, path: session.checkpoint_committed(s, str(path)),
                                  # a full or read-only disk costs this checkpoint, not the run
                                  on_fail=session.checkpoint_failed)
    finally:
        if checkpointer is not None:
            checkpointer.close()
        if metrics is not None:
            metrics.close()


def _hang_marker(cfg: TrainConfig) -> Path:
    return Path(cfg.ckpt_dir or ".") / f".hang-injected-{cfg.hang_at_step}"


def _hang_here(cfg: TrainConfig, step: int) -> None:
    """Fault injection (hang_at_step): stop forever, as a rank stuck in a driver call would.
    Once per run: a marker next to the checkpoints keeps the restarted round from hanging
    again at the same step."""
    _hang_marker(cfg).parent.mkdir(parents=True, exist_ok=True)
    _hang_marker(cfg).touch()
    print(f"injected hang at step {step}", flush=True)
    while True:
        time.sleep(3600)


def lr_scale_span(cfg: TrainConfig, start_step: int, extra: dict) -> tuple[int, int] | None:
    """The optimizer steps (first, last) that run at lr x cfg.lr_scale (see TrainConfig).

    A checkpoint records its run's span; resuming it under the same order continues that span,
    so a restart in the middle of it changes nothing. A new order starts after `start_step`.
    """
    if cfg.lr_scale_steps == 0 or cfg.lr_scale == 1.0:
        return None
    recorded = extra.get("lr_scale")
    if (recorded is not None and recorded["scale"] == cfg.lr_scale
            and recorded["last"] - recorded["first"] + 1 == cfg.lr_scale_steps):
        return recorded["first"], recorded["last"]
    return start_step + 1, start_step + cfg.lr_scale_steps


def _log(metrics, row: dict) -> None:
    if metrics is not None:
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()


def _checkpoint_now(session: Session, step: int, cfg: TrainConfig, device: torch.device) -> bool:
    """Every rank must reach the same answer: a save is collective."""
    wanted = session.should_checkpoint(step, cfg.ckpt_every) or step == cfg.steps
    if session.connected:
        # A daemon request reaches the ranks' agents at slightly different times; take it
        # if any rank has it.
        flag = torch.tensor(int(wanted), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        wanted = bool(flag.item())
    return wanted


def _fields(obj) -> dict:
    return {name: getattr(obj, name) for name in obj.__slots__}
