"""The trainer's one seam: hooks called at the phase boundaries a rank reports.

A rank tells its agent which phase of a step it enters (lazarus.trainer.session, `progress`):
data -> forward -> collective -> optimizer, then checkpoint on a step that saves. Right after
each report the training loop calls every registered hook as ``hook(phase, ctx)``. Time a hook
spends counts to that phase, as the agent sees it: a pause in "checkpoint" is a slow save, and a
rank that stops in "data" is one its peers wait for.

Plugins attach from outside the product: the worker imports the ones $LAZARUS_TRAINER_HOOKS
names ("package.module:function", comma-separated) and calls each function once with the
PhaseHooks to register on. Fault injection (lazarus.sim.trainer_faults) is such a plugin;
training code never names it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lazarus.core.errors import UserError

if TYPE_CHECKING:  # annotations only: importing this module must not load torch
    import torch

    from lazarus.core.trainconfig import TrainConfig
    from lazarus.trainer.data import SequenceLoader
    from lazarus.trainer.steptime import ComputeClock

HOOKS_ENV = "LAZARUS_TRAINER_HOOKS"
PHASES = ("data", "forward", "collective", "optimizer", "checkpoint")


@dataclass(kw_only=True, slots=True)
class StepContext:
    """What a hook sees of the rank and its current step.

    loader: the data loader; a hook may read its geometry (dp rank, micro-batch, dataset),
        never advance it.
    clock: this step's compute clock; clock.elapsed_cpu() is the CPU time spent so far.
    settle: waits until the checkpoint in flight, if any, is committed.
    window, batch: from "forward" on, the data window the step reads and this rank's
        micro-batches; a hook may replace `batch` (same shapes) before the forward pass.
    """
    cfg: TrainConfig
    rank: int
    loader: SequenceLoader
    clock: ComputeClock
    settle: Callable[[], None]
    step: int = 0
    window: dict | None = None
    batch: list[tuple[torch.Tensor, torch.Tensor]] | None = None


PhaseHook = Callable[[str, StepContext], None]


class PhaseHooks:
    def __init__(self) -> None:
        self._hooks: list[PhaseHook] = []

    def add(self, hook: PhaseHook) -> None:
        self._hooks.append(hook)

    def __call__(self, phase: str, ctx: StepContext) -> None:
        for hook in self._hooks:
            hook(phase, ctx)


def from_env(environ: Mapping[str, str] = os.environ) -> PhaseHooks:
    """The hooks of the plugins $LAZARUS_TRAINER_HOOKS names (none if it is unset)."""
    hooks = PhaseHooks()
    for spec in filter(None, (s.strip() for s in environ.get(HOOKS_ENV, "").split(","))):
        module, _, name = spec.partition(":")
        try:
            attach = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise UserError(f"{HOOKS_ENV}: cannot load {spec!r} (want package.module:function): {e}") from None
        attach(hooks)
    return hooks
