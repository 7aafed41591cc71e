"""The training loop of one rank: build the sharded model, restore, and step.

Each step reads top to bottom: lr -> micro-steps -> clip -> step -> log -> checkpoint. The
process group is already initialised by the caller (lazarus.trainer.worker).
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
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer, lr_at, set_lr
from lazarus.trainer.parallelize import ParallelConfig, build_mesh, build_model, device_type
from lazarus.trainer.session import Session

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

    The loss is averaged over the data-parallel group, so every rank returns the loss of the
    whole global batch. A non-finite loss skips the update on every rank alike.
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
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    loss_value = loss_sum.item()
    applied = bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(grad_norm))
    if applied:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm, foreach=True)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, grad_norm.item(), applied


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

    model = build_model(get_model_config(cfg.model), mesh,
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
    if restore is not None:
        extra = ckpt.load_checkpoint(Path(restore), model, optimizer)
        step = int(extra["step"])
        loader.load_state_dict(extra["loader"])
        if rank == 0:
            print(f"resumed from {restore} at step {step}", flush=True)

    checkpointer = (ckpt.Checkpointer(Path(cfg.ckpt_dir), keep_last=cfg.keep_last)
                    if cfg.ckpt_dir is not None else None)
    metrics = open(cfg.metrics, "a", encoding="utf-8") if rank == 0 and cfg.metrics else None
    dp_group = mesh["dp"].get_group()
    try:
        while step < cfg.steps:
            step += 1
            if fail_at_step == step:
                if checkpointer is not None:
                    checkpointer.wait()
                os._exit(FAULT_EXIT_CODE)
            t0 = time.perf_counter()

            lr = lr_at(step, schedule)
            set_lr(optimizer, lr)
            loss, grad_norm, applied = train_step(model, optimizer, loader.next_step(), device=device,
                                                  grad_clip=cfg.grad_clip, loss_group=dp_group)

            result = StepResult(step=step, loss=loss, grad_norm=grad_norm, lr=lr,
                                tokens=cfg.global_batch * cfg.seq_len, step_time_s=time.perf_counter() - t0)
            session.report(**_fields(result), skipped=not applied)
            if metrics is not None:
                metrics.write(json.dumps(_fields(result)) + "\n")
                metrics.flush()
            if rank == 0:
                print(result.line(cfg.steps) + ("" if applied else " | skipped: non-finite loss"), flush=True)

            if checkpointer is not None and _checkpoint_now(session, step, cfg, device):
                checkpointer.save(step, model, optimizer,
                                  {"step": step, "loader": loader.state_dict(),
                                   "schedule": _fields(schedule), "global_batch": cfg.global_batch},
                                  async_save=cfg.async_checkpoint, commit_gate=session.may_commit,
                                  on_commit=lambda s, path: session.checkpoint_committed(s, str(path)))
    finally:
        if checkpointer is not None:
            checkpointer.close()
        if metrics is not None:
            metrics.close()


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
