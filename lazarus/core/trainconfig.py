"""The training job's settings: a [train] table in sections, one small dataclass each.

    [train]
    steps = 10000
    seed = 0
    metrics = "/runs/demo/metrics.jsonl"   # one JSON line per step, written by rank 0

    [train.model]          # ModelSpec
    name = "small"
    [train.parallelism]    # ParallelConfig; a cluster job derives dp from its nodes
    tp = 2
    [train.optimizer]      # OptimizerConfig: AdamW and the learning-rate schedule
    lr = 3e-4
    [train.data]           # DataConfig: the corpus, the batch, the windows left out
    global_batch = 256
    seq_len = 1024
    [train.checkpoint]     # CheckpointConfig
    dir = "/checkpoints/llama-small"
    every = 100
    [train.guard]          # GuardConfig: which steps are spikes

`lazarus train` flags map onto the same fields (--tp is parallelism.tp, --ckpt-dir is
checkpoint.dir). Pure data and arithmetic: the daemon and `lazarus submit` check a job with it
without loading torch, and every check that can be made before a process starts is made here,
so a bad job fails with one line naming the setting as section.key.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.core.batching import plan_batches
from lazarus.core.errors import UserError
from lazarus.core.modelconfig import check_tp_fits, get_model_config

# Learning-rate schedules lazarus.trainer.optim implements.
SCHEDULES = ("cosine", "wsd")


def _at_least(name: str, value, minimum) -> None:
    if value < minimum:
        raise UserError(f"{name} must be at least {minimum}, got {value}" if minimum
                        else f"{name} must not be negative, got {value}")


def _positive(name: str, value: float) -> None:
    if not value > 0:  # NaN too
        raise UserError(f"{name} must be positive, got {value}")


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """name: a preset of lazarus.core.modelconfig.MODEL_SIZES. fused_kernels: the Triton
    kernels of lazarus.trainer.kernels instead of eager torch."""
    name: str = "tiny"
    fused_kernels: bool = False

    def __post_init__(self) -> None:
        get_model_config(self.name)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """A dp x tp mesh (FSDP2 over dp, TP inside a node), and what parallelize does to each
    block on the way: activation checkpointing, torch.compile."""
    dp: int = 1
    tp: int = 1
    activation_checkpointing: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        _at_least("parallelism.dp", self.dp, 1)
        _at_least("parallelism.tp", self.tp, 1)


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (lazarus.trainer.optim.lr_at).

    lr_scale, lr_scale_steps: the lr is multiplied by lr_scale for lr_scale_steps optimizer
    steps after the step the run starts from (its restore step, 0 for a fresh run); a rollback
    sets them. The checkpoints taken meanwhile record that span, so resuming one with the same
    two settings continues it rather than starting a new one.
    """
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    schedule: str = "cosine"
    wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    lr_scale: float = 1.0
    lr_scale_steps: int = 0

    def __post_init__(self) -> None:
        for key in ("lr", "min_lr", "grad_clip", "lr_scale"):
            _positive(f"optimizer.{key}", getattr(self, key))
        if self.min_lr > self.lr:
            raise UserError(f"optimizer.min_lr {self.min_lr} is above optimizer.lr {self.lr}")
        _at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        _at_least("optimizer.lr_scale_steps", self.lr_scale_steps, 0)
        if not 0 < self.wsd_decay_fraction <= 1:
            raise UserError(f"optimizer.wsd_decay_fraction must be in (0, 1], got {self.wsd_decay_fraction}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"optimizer.schedule must be one of {', '.join(SCHEDULES)}, "
                            f"got {self.schedule!r}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """dir: a corpus directory (lazarus.trainer.corpus); None: the stdlib corpus, built on demand.
    global_batch: sequences per optimizer step, whatever dp is. micro_batch: sequences per
    forward pass; None: derived (lazarus.core.batching.plan_batches).
    skip_windows: [first, last] sequence cursors, inclusive, never trained (lazarus.trainer.
    windows); the daemon adds the spiking ones when it rolls back."""
    dir: str | None = None
    global_batch: int = 8
    micro_batch: int | None = None
    seq_len: int = 128
    skip_windows: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _at_least("data.global_batch", self.global_batch, 1)
        _at_least("data.seq_len", self.seq_len, 1)
        if self.micro_batch is not None:
            _at_least("data.micro_batch", self.micro_batch, 1)
        for i, window in enumerate(self.skip_windows):
            if not (len(window) == 2 and 0 <= window[0] <= window[1]):
                raise UserError(f"data.skip_windows[{i}] must be [first, last] with "
                                f"0 <= first <= last, got {window}")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """dir: where checkpoints go (None: none are taken). every: a save every N steps (0: only
    at the end). resume: "latest" (the newest committed in dir) or a checkpoint path.
    good_after_steps: retention keeps the newest checkpoint with no skipped step in this many
    steps after it. memory_every: a tier-0 snapshot into host memory every N steps, under a
    node agent (lazarus.trainer.snapshot); 0: as often as its stall stays under 1% of the
    step time; -1: none."""
    dir: str | None = None
    every: int = 0
    keep_last: int = 3
    async_save: bool = True
    resume: str | None = None
    good_after_steps: int = 10
    memory_every: int = 0

    def __post_init__(self) -> None:
        _at_least("checkpoint.every", self.every, 0)
        _at_least("checkpoint.memory_every", self.memory_every, -1)
        _at_least("checkpoint.keep_last", self.keep_last, 1)
        _at_least("checkpoint.good_after_steps", self.good_after_steps, 0)
        if self.resume == "latest" and self.dir is None:
            raise UserError("checkpoint.resume = 'latest' needs checkpoint.dir")


@dataclass(kw_only=True, slots=True)
class GuardConfig:
    """Spike detection policy of the step guard (lazarus.trainer.guard, which explains the
    judgement). The defaults are what tests/bench/bench_guard.py measured best.

    window: accepted steps the trends of the loss and the gradient norm are fitted over; their
        noise is taken over the forecast errors of 10 x window accepted steps (>= 3).
    threshold: how many robust standard deviations of its forecast errors the loss must rise
        above its trend to be a spike on its own (> 1; the gradient norm alone needs 3x as
        many, both together 0.7x each: lazarus.trainer.guard's GRAD_Z_FACTOR and JOINT_SHARE;
        `inf` turns spike detection off and keeps only the
        NaN/Inf check).
    min_history: accepted steps needed before any spike verdict (4 <= min_history <= window:
        the spread needs forecast errors, and the first comes with the fourth step).
    grad_ratio: the gradient norm alone is a spike only at this many times its trend (> 1).
    loss_ratio: the smallest loss spike, in times its trend: a loss below it is never a spike,
        however quiet the run (> 1).
    """
    window: int = 20
    threshold: float = 5.0
    min_history: int = 8
    grad_ratio: float = 5.0
    loss_ratio: float = 1.3

    def __post_init__(self) -> None:
        _at_least("guard.window", self.window, 3)
        if not self.threshold > 1:
            raise UserError(f"guard.threshold must be greater than 1 (a robust z-score), got {self.threshold}")
        for key in ("grad_ratio", "loss_ratio"):
            if not getattr(self, key) > 1:
                raise UserError(f"guard.{key} must be greater than 1, got {getattr(self, key)}")
        if not 4 <= self.min_history <= self.window:
            raise UserError(f"guard.min_history must be between 4 and guard.window ({self.window}), "
                            f"got {self.min_history}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """A valid job: built from a dict (`from_dict`, every key and type checked) or in code."""
    steps: int = 100
    seed: int = 0
    metrics: str | None = None
    # Bit-exact resume on CUDA: deterministic kernels (docs/gpus.md says what it costs). CPU
    # runs are deterministic either way.
    deterministic: bool = False
    # The bf16 dense peak of one accelerator, in TFLOP/s, for the MFU of each step's metrics
    # line; None: from the device's name (lazarus.core.flops.PEAK_TFLOPS), no MFU if unknown.
    peak_tflops: float | None = None
    model: ModelSpec = field(default_factory=ModelSpec)
    parallelism: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        _at_least("steps", self.steps, 1)
        _at_least("seed", self.seed, 0)
        if self.peak_tflops is not None:
            _positive("peak_tflops", self.peak_tflops)
        model, data, par = get_model_config(self.model.name), self.data, self.parallelism
        if data.seq_len > model.max_seq_len:
            raise UserError(f"data.seq_len {data.seq_len} exceeds model {self.model.name}'s "
                            f"maximum {model.max_seq_len}")
        check_tp_fits(model, par.tp, data.seq_len)
        plan_batches(data.global_batch, par.dp, data.micro_batch)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """From a [train] table; UserError naming the first unknown or mistyped key."""
        if not isinstance(d, dict):
            raise UserError(f"the train settings must be a table, got {d!r}")
        return _build(cls, d, section=None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_types(table: dict) -> None:
    """UserError naming the first unknown or mistyped key of a [train] table; the checks
    across settings (which need the node count) are TrainConfig's."""
    if not isinstance(table, dict):
        raise UserError(f"the train settings must be a table, got {table!r}")
    _build(TrainConfig, table, section=None, construct=False)


def _sections() -> dict[str, type]:
    return {k: t for k, t in typing.get_type_hints(TrainConfig).items() if dataclasses.is_dataclass(t)}


def _build(cls: type, table: dict, *, section: str | None, construct: bool = True):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in table.items():
        name = key if section is None else f"{section}.{key}"
        hint = hints.get(key)
        if hint is None:
            raise UserError(_unknown(name, section, hints))
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise UserError(f"train setting {name!r} must be a table ([train.{name}]), got {value!r}")
            kwargs[key] = _build(hint, value, section=name, construct=construct)
            continue
        if not _fits(value, hint):
            raise UserError(f"train setting {name!r} must be {_type_name(hint)}, got {value!r}")
        kwargs[key] = float(value) if hint is float else value
    return cls(**kwargs) if construct else None


def _unknown(name: str, section: str | None, hints: dict) -> str:
    if section is not None:
        return f"unknown train setting {name!r} (known in [train.{section}]: {', '.join(hints)})"
    home = [s for s, t in _sections().items() if name in typing.get_type_hints(t)]
    if home:
        return f"unknown train setting {name!r}: it belongs in [train.{home[0]}] ({home[0]}.{name})"
    plain = [k for k in hints if k not in _sections()]
    return (f"unknown train setting {name!r} (known: {', '.join(plain)}, and the tables "
            + ", ".join(f"[train.{s}]" for s in _sections()) + ")")


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
