"""AdamW with the usual LLM settings, and the learning-rate schedules as pure functions of step.

A schedule that is a function of the step alone needs no state of its own in a checkpoint: the
step number restores it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lazarus.core.errors import UserError
from lazarus.core.trainconfig import SCHEDULES


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    schedule: str
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    # WSD: the share of the run spent decaying at the end, after the stable phase.
    decay_fraction: float = 0.2


def lr_at(step: int, cfg: ScheduleConfig) -> float:
    """Learning rate of optimizer step `step` (counted from 1).

    Linear warmup to `lr` over `warmup_steps` (step 1 already moves: lr / warmup_steps), then
    cosine: a half cosine down to `min_lr` at `total_steps`;
    wsd (warmup-stable-decay): flat at `lr`, then a linear decay to `min_lr` over the last
    `decay_fraction` of the run.
    """
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
        progress = min(progress, 1.0)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * cfg.total_steps))
        decay_start = max(cfg.warmup_steps, cfg.total_steps - decay_steps)
        if step <= decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start) / max(1, cfg.total_steps - decay_start))
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    raise UserError(f"unknown schedule {cfg.schedule!r}; choose one of {', '.join(SCHEDULES)}")


def _no_decay(name: str, param: torch.Tensor) -> bool:
    # Decaying a norm's gain or an embedding row pulls it toward zero for no regularising gain.
    return param.ndim < 2 or "tok_embeddings" in name or name.endswith("norm.weight")


def adamw_implementation(device_type: str) -> dict[str, bool]:
    """AdamW's implementation flag for parameters on `device_type`.

    CUDA: fused, the whole update in one pass over each parameter's memory where foreach
    makes a pass per arithmetic op (torchtitan's default, DTensor parameters of FSDP2 and TP
    included). Elsewhere foreach, as before: CPU has a fused AdamW too, but it rounds
    differently, and the CPU runs' numbers, which the tests compare, should not move for it.
    """
    return {"fused": True} if device_type == "cuda" else {"foreach": True}


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW (0.9, 0.95); weight decay on the matrices, none on norms and embeddings. Build it
    once the model is on its device: the implementation follows the parameters' device."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        (plain if _no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    device_type = next(model.parameters()).device.type
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                             **adamw_implementation(device_type))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
