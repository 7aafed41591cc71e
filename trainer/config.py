"""The training job's settings: one flat dataclass, built from a TOML [train] table and/or flags.

Every check that can be made without starting a process is made here, so a bad job fails in
the launcher with one line naming the setting, before anything is spawned or written.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.trainer.batching import plan_batches
from lazarus.trainer.guard import GuardConfig
from lazarus.trainer.models import get_model_config
from lazarus.trainer.optim import SCHEDULES, ScheduleConfig
from lazarus.trainer.parallelize import check_tp_fits
from lazarus.trainer.steptime import parse_stall
from lazarus.trainer.windows import check_skip_window, parse_injection


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: str = "tiny"
    dp: int = 1
    tp: int = 1
    steps: int = 100
    global_batch: int = 8          # sequences per optimizer step, whatever dp is
    micro_batch: int | None = None  # None: derived (see batching.plan_batches)
    seq_len: int = 128
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    schedule: str = "cosine"
    wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    data: str | None = None        # corpus directory; None: the stdlib corpus, built on demand
    ckpt_dir: str | None = None
    ckpt_every: int = 0            # 0: only at the end of the run
    keep_last: int = 3
    async_checkpoint: bool = True
    resume: str | None = None      # "latest" (newest committed in ckpt_dir) or a checkpoint path
    metrics: str | None = None     # JSON lines, one per step, written by rank 0
    fused_kernels: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    # Step guard (trainer/guard.py: GuardConfig documents each).
    guard_window: int = 50
    guard_threshold: float = 6.0
    guard_min_history: int = 25
    guard_grad_ratio: float = 8.0
    # Data windows (trainer/windows.py): [first, last] sequence cursors, inclusive, never
    # trained; the daemon adds the spiking ones when it rolls back.
    skip_windows: list[list[int]] = field(default_factory=list)
    # The lr is multiplied by lr_scale for lr_scale_steps optimizer steps after the step the
    # run starts from (its restore step, 0 for a fresh run). The checkpoints taken meanwhile
    # record that span, so resuming one with the same two settings continues it rather than
    # starting a new one; other settings start a new span at the new restore step.
    lr_scale: float = 1.0
    lr_scale_steps: int = 0
    # Fault injection, keyed on data windows: "loss-spike@STEP", "diverge@STEP".
    inject: list[str] = field(default_factory=list)
    # Fault injection: rank `hang_rank` stops forever at step `hang_at_step` (0: never), once
    # per run (a marker file in ckpt_dir remembers it).
    hang_at_step: int = 0
    hang_rank: int = 0
    # Fault injection: every rank pauses `stall_s` seconds, once per run, in the forward phase
    # of step S ("step@S") or in the checkpoint phase of the first save at or after step S
    # ("checkpoint@S"): a slow first step or a slow filesystem, which must not look like a hang.
    stalls: list[str] = field(default_factory=list)
    stall_s: float = 4.0
    # Retention keeps the newest checkpoint with no skipped step in this many steps after it.
    good_after_steps: int = 10

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(d) - set(hints))
        if unknown:
            raise UserError(f"unknown train setting {unknown[0]!r} (known: {', '.join(hints)})")
        for key, value in d.items():
            _check_type(key, value, hints[key])
        cfg = cls(**{k: float(v) if hints[k] is float else v for k, v in d.items()})
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        positive = ("dp", "tp", "steps", "global_batch", "seq_len", "keep_last")
        for key in positive:
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be at least 1, got {getattr(self, key)}")
        for key in ("warmup_steps", "ckpt_every", "seed", "hang_at_step", "hang_rank",
                    "good_after_steps"):
            if getattr(self, key) < 0:
                raise UserError(f"{key} must not be negative, got {getattr(self, key)}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise UserError(f"micro_batch must be at least 1, got {self.micro_batch}")
        for key in ("lr", "min_lr", "grad_clip"):
            if not getattr(self, key) > 0:
                raise UserError(f"{key} must be positive, got {getattr(self, key)}")
        if self.min_lr > self.lr:
            raise UserError(f"min_lr {self.min_lr} is above lr {self.lr}")
        if not 0 < self.wsd_decay_fraction <= 1:
            raise UserError(f"wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        model = get_model_config(self.model)
        if self.seq_len > model.max_seq_len:
            raise UserError(f"seq_len {self.seq_len} exceeds model {self.model}'s maximum {model.max_seq_len}")
        check_tp_fits(model, self.tp, self.seq_len)
        plan_batches(self.global_batch, self.dp, self.micro_batch)
        if self.resume is not None and self.resume == "latest" and self.ckpt_dir is None:
            raise UserError("resume = 'latest' needs ckpt_dir")
        self.guard_config()
        for i, window in enumerate(self.skip_windows):
            check_skip_window(i, window)
        if not self.lr_scale > 0:
            raise UserError(f"lr_scale must be positive, got {self.lr_scale}")
        if self.lr_scale_steps < 0:
            raise UserError(f"lr_scale_steps must not be negative, got {self.lr_scale_steps}")
        for spec in self.inject:
            parse_injection(spec)
        for spec in self.stalls:
            parse_stall(spec)
        if not self.stall_s > 0:
            raise UserError(f"stall_s must be positive, got {self.stall_s}")

    def schedule_config(self) -> ScheduleConfig:
        return ScheduleConfig(schedule=self.schedule, lr=self.lr, min_lr=self.min_lr,
                              warmup_steps=self.warmup_steps, total_steps=self.steps,
                              decay_fraction=self.wsd_decay_fraction)

    def guard_config(self) -> GuardConfig:
        return GuardConfig(window=self.guard_window, threshold=self.guard_threshold,
                           min_history=self.guard_min_history, grad_ratio=self.guard_grad_ratio)


def _check_type(key: str, value, hint) -> None:
    if not _fits(value, hint):
        raise UserError(f"train setting {key!r} must be {_type_name(hint)}, got {value!r}")


def _fits(value, hint) -> bool:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    allowed = typing.get_args(hint) or (hint,)
    # bool is an int to Python; `steps = true` is still a mistake.
    return any(
        (t is type(None) and value is None)
        or (t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (t is int and isinstance(value, int) and not isinstance(value, bool))
        or (t in (str, bool) and isinstance(value, t))
        for t in allowed
    )


def _type_name(hint) -> str:
    if typing.get_origin(hint) is list:
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    allowed = typing.get_args(hint) or (hint,)
    return " or ".join("none" if t is type(None) else t.__name__ for t in allowed)


def load_toml(path: str | Path) -> dict:
    """The [train] table of a TOML job file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"job file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"job file {path} is not valid TOML: {e}") from None
    table = doc.get("train")
    if not isinstance(table, dict):
        raise UserError(f"job file {path} has no [train] table")
    return table
