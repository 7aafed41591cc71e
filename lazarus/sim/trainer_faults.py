"""Faults inside a training rank, injected through the trainer's phase hooks
(lazarus.trainer.hooks), never by code of the training loop.

A rank whose environment names this plugin ($LAZARUS_TRAINER_HOOKS = HOOK) reads its faults
from $LAZARUS_TRAINER_FAULTS, a comma-separated list:

    hang@STEP[:RANK]       rank RANK (default 0) stops forever in STEP's data phase, as a rank
                           stuck in a driver call would: its peers wait for it in a collective
    crash@STEP[:RANK]      rank RANK exits with exitcodes.INJECTED_FAULT as STEP starts, once
                           any checkpoint in flight is committed (a test knows which survives)
    slow-step@STEP         every rank pauses STALL_S seconds in STEP's forward phase
    slow-checkpoint@STEP   every rank pauses STALL_S seconds in the checkpoint phase of the
                           first save at or after STEP: a slow filesystem, which must not look
                           like a hang
    loss-spike@STEP        the data window STEP reads in an uninterrupted run without skips is
                           poisoned: each of its sequences is replaced by one garbage token
                           repeated (ids from the upper half of the vocabulary, which
                           byte-level source text never uses), a real batch with a real loss and
                           gradient spike. Skip that window and the poison is gone.
    diverge@STEP           the same over the DIVERGE_STEPS consecutive windows from STEP's: the
                           guard fires on each, the repetition the daemon answers with a
                           rollback, and once a rollback skips the span the run is back on course

hang, slow-step and slow-checkpoint strike once per run: a marker file beside the checkpoints
(checkpoint.dir, else the working directory) remembers them, so a restarted round goes on.
Data faults are keyed on data cursors, not steps, so they are reproducible and restart-proof.

A slowdown comes from the script $LAZARUS_SLOWDOWN_FILE names (lazarus.sim.chaos writes it):
{"factor": F} makes the rank's step work take F times as long, as a slower machine would.

`worker_env` is the environment that sets all this up: the local cluster gives it to its
agents, which pass it on to their ranks, and tests give it to `lazarus train`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lazarus.core.errors import UserError
from lazarus.core.exitcodes import INJECTED_FAULT
from lazarus.core.modelconfig import get_model_config
from lazarus.trainer.hooks import HOOKS_ENV, PhaseHooks, StepContext

# torch only in the ranks, where it is loaded already: `lazarus up` and the tests' clusters
# import this module for worker_env, and torch is 2-4 CPU-seconds of every such start.
if TYPE_CHECKING:
    import torch

    from lazarus.trainer.data import SequenceLoader
    from lazarus.trainer.steptime import ComputeClock

HOOK = "lazarus.sim.trainer_faults:attach"
FAULTS_ENV = "LAZARUS_TRAINER_FAULTS"
SLOWDOWN_ENV = "LAZARUS_SLOWDOWN_FILE"
KINDS = ("hang", "crash", "slow-step", "slow-checkpoint", "loss-spike", "diverge")
_RANKED = ("hang", "crash")
# How long slow-step and slow-checkpoint pause every rank.
STALL_S = 4.0
# Poisoned steps of a divergence: more than the daemon's default of 3 spikes for a rollback.
DIVERGE_STEPS = 5
_ITEM = re.compile(r"(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<rank>\d+))?")


@dataclass(frozen=True, slots=True)
class TrainerFault:
    kind: str
    step: int
    rank: int = 0


def parse(spec: str) -> list[TrainerFault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        m = _ITEM.fullmatch(item)
        if m is None or m["kind"] not in KINDS or int(m["step"]) < 1 \
                or (m["rank"] is not None and m["kind"] not in _RANKED):
            raise UserError(f"trainer fault {item!r} must be KIND@STEP (STEP >= 1) with KIND one "
                            f"of {', '.join(KINDS)}; {' and '.join(_RANKED)} take :RANK")
        faults.append(TrainerFault(kind=m["kind"], step=int(m["step"]), rank=int(m["rank"] or 0)))
    return faults


def worker_env(faults: Sequence[str] = (), *, slowdown: Path | None = None) -> dict[str, str]:
    """The environment that makes a rank inject `faults` ("KIND@STEP[:RANK]") and read its
    slowdown from the script at `slowdown`."""
    spec = ",".join(faults)
    parse(spec)  # a bad fault fails here, not in every rank
    env = {HOOKS_ENV: HOOK, FAULTS_ENV: spec}
    if slowdown is not None:
        env[SLOWDOWN_ENV] = str(slowdown)
    return env


def attach(hooks: PhaseHooks) -> None:
    """The plugin's entry point (lazarus.trainer.hooks.from_env calls it in every rank)."""
    hooks.add(Injector(parse(os.environ.get(FAULTS_ENV, "")), Slowdown(os.environ.get(SLOWDOWN_ENV))))


class Injector:
    """One rank's faults, struck at the phase boundaries the module docstring names."""

    def __init__(self, faults: list[TrainerFault], slowdown: Slowdown):
        self.faults, self.slowdown = faults, slowdown
        self.stalls = [f for f in faults if f.kind in ("slow-step", "slow-checkpoint")]
        self.data: DataFaults | None = None

    def __call__(self, phase: str, ctx: StepContext) -> None:
        if phase == "data":
            self.slowdown.refresh()
            for f in self.faults:
                if f.kind in _RANKED and (f.step, f.rank) == (ctx.step, ctx.rank):
                    if f.kind == "crash":
                        ctx.settle()
                        os._exit(INJECTED_FAULT)
                    marker = _marker_dir(ctx) / f".hang-injected-{f.step}"
                    if not marker.exists():
                        _hang_here(marker, ctx.step)
        elif phase == "forward":
            if self.data is None:
                self.data = DataFaults(self.faults, ctx.loader,
                                       vocab_size=get_model_config(ctx.cfg.model.name).vocab_size)
            ctx.batch = self.data.poison(ctx.window, ctx.batch)
            self._stall("slow-step", ctx)
        elif phase == "collective":
            self.slowdown.apply(ctx.clock)
        elif phase == "checkpoint":
            self._stall("slow-checkpoint", ctx)

    def _stall(self, kind: str, ctx: StepContext) -> None:
        for f in list(self.stalls):
            if f.kind != kind or ctx.step < f.step or (kind == "slow-step" and ctx.step != f.step):
                continue
            self.stalls.remove(f)
            marker = _marker_dir(ctx) / f".stall-{kind.removeprefix('slow-')}-{f.step}"
            if marker.exists():
                continue
            time.sleep(STALL_S)
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            except OSError:
                pass  # a full disk (disk-full chaos): the stall may come again, nothing worse


def _marker_dir(ctx: StepContext) -> Path:
    return Path(ctx.cfg.checkpoint.dir or ".")


def _hang_here(marker: Path, step: int) -> None:
    """Stop forever. The marker keeps the restarted round from hanging again at this step."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    print(f"injected hang at step {step}", flush=True)
    while True:
        time.sleep(3600)


class DataFaults:
    """loss-spike and diverge: the poisoned spans of data cursors, and the poison itself."""

    def __init__(self, faults: list[TrainerFault], loader: SequenceLoader, *, vocab_size: int):
        from lazarus.trainer.windows import window_of_step  # torch: only ranks make DataFaults
        self.loader, self.vocab_size = loader, vocab_size
        self.spans: list[tuple[int, int]] = []
        for f in faults:
            if f.kind in ("loss-spike", "diverge"):
                last_step = f.step + (DIVERGE_STEPS - 1 if f.kind == "diverge" else 0)
                self.spans.append((window_of_step(loader, f.step)[0], window_of_step(loader, last_step)[1]))

    def poison(self, window: dict, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches, or garbage of the same shape if the window is poisoned."""
        import torch  # only ranks poison, and they have it loaded

        from lazarus.trainer.windows import overlaps  # torch, as above
        if not any(overlaps(window, span) for span in self.spans):
            return micro_batches
        # The garbage is a function of the window alone, cut like the loader cuts real data, so
        # it is the same batch whatever the mesh.
        gen = torch.Generator().manual_seed(window["first"])
        seq_len = micro_batches[0][0].shape[1]
        garbage = torch.randint(self.vocab_size // 2, self.vocab_size,
                                (self.loader.global_batch, 1), generator=gen).expand(-1, seq_len + 1)
        mine = garbage.chunk(self.loader.dp_size)[self.loader.dp_rank].split(self.loader.micro_batch)
        return [(rows[:, :-1], rows[:, 1:]) for rows in mine]


class Slowdown:
    """Burn CPU so that this rank's step work takes `factor` times as long, as a slower machine
    would. Reads the script at `path` at most once per change (a stat per step)."""

    def __init__(self, path: str | None = None):
        self.path = Path(path) if path else None
        self._mtime: float | None = None
        self.factor = 1.0

    def refresh(self) -> float:
        if self.path is None:
            return 1.0
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            self._mtime, self.factor = None, 1.0
            return self.factor
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                factor = float(json.loads(self.path.read_text())["factor"])
                self.factor = factor if factor >= 1.0 else 1.0
            except (OSError, ValueError, KeyError, TypeError):
                self.factor = 1.0  # a script being rewritten: read it again next step
                self._mtime = None
        return self.factor

    def apply(self, clock: ComputeClock) -> None:
        """Spin until the step's CPU time is `factor` times what it was."""
        if self.factor <= 1.0:
            return
        target = clock.elapsed_cpu() * self.factor
        while clock.elapsed_cpu() < target:
            sum(range(2000))
