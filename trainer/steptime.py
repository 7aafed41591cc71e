"""A rank's own compute time per step, for the straggler test; and the faults that stretch
step time: a slow node (Slowdown) and stalls that a hang detector must sit out (Stalls).

In synchronous training every rank's wall step time is the slowest rank's (the collectives
wait), so the agents compare what each rank spent working instead:

- on CPU (gloo), the process's CPU time over the step: a rank blocked in a gloo collective
  sleeps on a socket and burns none, so a slow rank shows and its waiting peers do not;
- on CUDA, the device time of a fixed probe matmul queued on the compute stream each step
  (CUDA events, read a step later so nothing synchronizes): a GPU that is throttled, or
  slower for any reason, runs it slower. Kernel time of the step itself would include NCCL
  waits, and CPU time is no measure (the host spins in synchronizations).

Values are comparable between the ranks of one job, which is all the straggler test needs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from lazarus.sim.chaos import SLOWDOWN_ENV
from lazarus.core.errors import UserError

_PROBE_N = 1024


class ComputeClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._c0 = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._last: float | None = None
        if self.cuda:
            # Not randn: drawing from the global generator would shift the training's stream.
            self._probe = torch.full((_PROBE_N, _PROBE_N), 0.5, device=device,
                                     dtype=torch.bfloat16)

    def start(self) -> None:
        self._c0 = time.process_time()
        if self.cuda:
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            torch.mm(self._probe, self._probe)
            end.record()
            self._pending.append((begin, end))

    def elapsed_cpu(self) -> float:
        return time.process_time() - self._c0

    def stop(self) -> float | None:
        """This step's compute seconds (CPU), or the newest finished probe's (CUDA)."""
        if not self.cuda:
            return self.elapsed_cpu()
        while self._pending and self._pending[0][1].query():
            begin, end = self._pending.pop(0)
            self._last = begin.elapsed_time(end) / 1000.0
        del self._pending[:-4]  # a probe that never finishes is not worth waiting for
        return self._last


class Slowdown:
    """Fault injection: burn CPU so that this rank's step work takes `factor` times as long,
    as a slower machine would. Reads the script named by LAZARUS_SLOWDOWN_FILE, at most once
    per change (a stat per step)."""

    def __init__(self, path: str | None = None):
        self.path = Path(path) if path else None
        self._mtime: float | None = None
        self.factor = 1.0

    @classmethod
    def from_env(cls) -> "Slowdown":
        return cls(os.environ.get(SLOWDOWN_ENV))

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


STALL_PHASES = ("step", "checkpoint")


def parse_stall(spec: str) -> tuple[str, int]:
    phase, _, step = spec.partition("@")
    if phase not in STALL_PHASES or not step.isdigit() or int(step) < 1:
        raise UserError(f"stall {spec!r} is not PHASE@STEP with PHASE one of "
                        f"{', '.join(STALL_PHASES)} and STEP >= 1")
    return phase, int(step)


class Stalls:
    """Fault injection (TrainConfig.stalls): pause every rank for `seconds` in a phase, once
    per run; a marker file beside the checkpoints remembers a stall that happened, so a
    restarted round does not pause again."""

    def __init__(self, specs: list[str], seconds: float, marker_dir: Path):
        self.pending = [parse_stall(s) for s in specs]
        self.seconds, self.marker_dir = seconds, marker_dir

    def maybe(self, phase: str, step: int) -> None:
        for item in list(self.pending):
            kind, at = item
            if kind != phase or step < at or (kind == "step" and step != at):
                continue
            self.pending.remove(item)
            marker = self.marker_dir / f".stall-{kind}-{at}"
            if marker.exists():
                continue
            time.sleep(self.seconds)
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            except OSError:
                pass  # a full disk (disk-full chaos): the stall may come again, nothing worse
