"""The step guard: decides, before the optimizer step, whether a batch may update the model.

Verdicts, checked in this order (the first that applies is the reason given):

- ``nonfinite_loss`` / ``nonfinite_grad_norm``: the loss or the global gradient norm is NaN or
  infinite. Always checked, from the first step.
- ``loss_spike`` / ``grad_norm_spike``: the value is far above the recent history of accepted
  steps, by a robust z-score::

      z = (x - median) / max(1.4826 * MAD, 0.01 * |median|)      flagged when z > threshold

  where median and MAD (median absolute deviation from the median) are taken over the last
  `window` accepted steps. 1.4826 * MAD estimates the standard deviation of normal noise
  without being moved by the outliers themselves. The 1%-of-median floor keeps a nearly
  constant history (MAD close to 0) from turning any wobble into an infinite z.
  A gradient norm must also be at least `grad_ratio` times its median: healthy training
  moves its gradient norm by 3-4x within a few steps (measured here on the tiny model, with
  the loss flat), which a z-score over a quiet stretch would call a spike every step.

What the guard ignores, on purpose:

- values *below* the history (a sudden drop of loss or gradient norm is not a failure): the
  test is one-sided;
- everything before `min_history` accepted steps: the first steps of a run have a steep,
  noisy loss curve, so there is no statistic to trust yet (non-finite values still count);
- skipped steps: a flagged value never enters the history, so a spike cannot raise the bar
  for the next one, and a persistent blow-up is flagged on every step until something (the
  daemon's rollback) changes the model or the data.

A skipped step updates neither the parameters nor the optimizer state, but it is still a
step: its number, its data window and its place in the learning-rate schedule are used up, and
the next step reads the next window. Repeated skips are the daemon's signal to roll back.

The guard only sees numbers that are already global (the loss averaged over the data-parallel
group, the gradient norm of the whole model), and the trainer hands every rank rank 0's copy
of them, so every rank holds the same history and reaches the same verdict. Its state is part
of each checkpoint, so a resumed run judges exactly as the uninterrupted one would have.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from lazarus.core.trainconfig import GuardConfig

# 1.4826 * MAD is the standard deviation of normally distributed values.
MAD_TO_STD = 1.4826
# Noise floor relative to the median: see the module docstring.
RELATIVE_FLOOR = 0.01


class Guard:
    """Judges one step at a time; `observe` records the accepted ones."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self._loss: deque[float] = deque(maxlen=cfg.window)
        self._grad_norm: deque[float] = deque(maxlen=cfg.window)

    def observe(self, loss: float, grad_norm: float) -> str | None:
        """The reason to skip this step, or None: then the values join the history."""
        reason = self.verdict(loss, grad_norm)
        if reason is None:
            self._loss.append(loss)
            self._grad_norm.append(grad_norm)
        return reason

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        if not math.isfinite(loss):
            return "nonfinite_loss"
        if not math.isfinite(grad_norm):
            return "nonfinite_grad_norm"
        if len(self._loss) < self.cfg.min_history:
            return None
        if _zscore(loss, self._loss) > self.cfg.threshold:
            return "loss_spike"
        if (_zscore(grad_norm, self._grad_norm) > self.cfg.threshold
                and grad_norm >= self.cfg.grad_ratio * statistics.median(self._grad_norm)):
            return "grad_norm_spike"
        return None

    def state_dict(self) -> dict:
        """JSON-able; floats survive a JSON round trip exactly."""
        return {"loss": list(self._loss), "grad_norm": list(self._grad_norm)}

    def load_state_dict(self, state: dict) -> None:
        # A shorter window in the resumed job keeps the newest steps (deque maxlen).
        self._loss = deque(map(float, state["loss"]), maxlen=self.cfg.window)
        self._grad_norm = deque(map(float, state["grad_norm"]), maxlen=self.cfg.window)


def _zscore(x: float, history: deque[float]) -> float:
    median = statistics.median(history)
    mad = statistics.median(abs(v - median) for v in history)
    return (x - median) / max(MAD_TO_STD * mad, RELATIVE_FLOOR * abs(median))
