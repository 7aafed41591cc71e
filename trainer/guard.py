"""The step guard: decides, before the optimizer step, whether a batch may update the model.

Verdicts, checked in this order (the first that applies is the reason given):

- ``nonfinite_loss`` / ``nonfinite_grad_norm``: the loss or the global gradient norm is NaN or
  infinite. Always checked, from the first step.
A spike is a step far above where the recent trend says it should be, measured against the
run's own noise. The trend of a value (the loss, the gradient norm) is a robust straight line
(Tukey's resistant line: the slope joins the medians of the first and last thirds, the
intercept is the median of what is left) through the logarithms of its last `window` accepted
values, extended one step. A falling loss is then the trend, not noise: judged against the
median of a steeply falling history, as a plain z-score does, every early batch looks low and
a spike hides in the spread of the fall.

The noise is each accepted step's forecast error (its log-value minus what the trend forecast
for it), kept for the last 10 x `window` accepted steps, and a step's distance is::

    z = (e - median(errors)) / max(1.4826 * MAD(errors), 0.01)

where e is this step's forecast error and MAD the median absolute deviation from the median
(1.4826 * MAD estimates the standard deviation of normal noise without being moved by the
outliers themselves). Forecast errors, not the scatter around the fitted line: they also carry
the trend's own error where the curve bends (a loss that falls fast, then flattens). The 0.01
floor (1%: the values are logarithms) keeps a nearly noiseless history from turning any wobble
into an infinite z. 200 errors, not a few dozen: the MAD of 60 values is itself off by a
quarter now and then, and a long run meets every such dip.

- ``loss_spike``, one witness: the loss is at least `loss_ratio` (1.3) times its reference (the
  trend, or the lowest of the last 3 accepted losses if higher: where a falling curve
  flattens the line undershoots for a few steps) AND either more than `threshold` (5) of its
  noise above the trend or at least 2x the reference. The size says what is worth a skip, the
  noise what this run's clean batches do: a run of tiny batches (4 x 32 tokens here) has
  clean batches 1.5-2x their trend every hundred steps, and the 1.5x ceiling this guard had
  before skipped one of them every 50-100 steps late in such a run. A run of large batches,
  whose loss barely moves (production batches of millions of tokens: a percent or two), is
  guarded down to 1.3x. The 2x ceiling holds where the noise learnt is itself wild (a run
  unstable from its first steps).
- ``loss_spike``, two witnesses: the loss at least `loss_ratio` times its reference and the
  gradient norm at least 2x its own trend, each more than 0.7 x `threshold` of its noise
  above. A bad batch moves both (a poisoned batch of the issue-13 run: loss 1.4x, grad norm
  8x); healthy noise rarely moves both far at once (their forecast errors correlate by ~0.3 at
  4 x 32).
- ``grad_norm_spike``: the gradient norm alone, at least `grad_ratio` (5) times its trend and
  either more than 3 x `threshold` of its noise above it or at least 8x the trend. Healthy
  gradient norms have heavy tails (at 4 x 32 tokens one step in a thousand is 13 robust
  deviations above its trend, and 5-9x jumps with an ordinary loss come every few hundred
  steps), so the gradient norm alone must be much further out than the loss alone.

tests/bench/bench_guard.py measures what these bars catch and what they wrongly skip.

What the guard ignores, on purpose:

- values *below* the trend (a sudden drop of loss or gradient norm is not a failure): the
  tests are one-sided;
- everything before `min_history` accepted steps (non-finite values still count);
- a non-positive loss or gradient norm (a loss other than a cross-entropy, a model with no
  gradient): the trends live in logarithms, so that witness abstains;
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

Pure Python, no torch: O(W log W) per step for W = 10 x `window` (a few medians of the
kept errors).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from lazarus.core.trainconfig import GuardConfig

# 1.4826 * MAD is the standard deviation of normally distributed values.
MAD_TO_STD = 1.4826
# Smallest spread of a forecast error (log space: 1% of the value); see above.
NOISE_FLOOR = 0.01
# A trend needs this many points; before that there is no forecast and no forecast error.
TREND_POINTS = 3
# Forecast errors kept, in windows: the spread of a run's noise is a slow thing, and the MAD of
# a few dozen values is itself off by a quarter now and then, which at a z of 5 moves the bar
# by more than the noise (tests/bench/bench_guard.py).
ERROR_WINDOWS = 10
# Healthy gradient norms have heavy tails (measured on the tiny model at 4 x 32 tokens a step:
# 1 step in 1,000 is 13 robust standard deviations above its trend), so the gradient norm alone
# must be much further out than the loss alone.
GRAD_Z_FACTOR = 3.0
# Two witnesses: a loss above `loss_ratio` x its reference and a gradient norm above this many
# times its own trend, each beyond this share of the single-witness bar. A bad batch moves both;
# the noise of healthy training rarely moves both far at once (their forecast errors correlate
# by ~0.3 at 4 x 32).
JOINT_GRAD_RATIO = 2.0
JOINT_SHARE = 0.7
# Ceilings, whatever the run's noise: a run unstable from its first steps (a learning rate far
# too high) learns its own wildness as noise, and no spike would stand out of it.
LOSS_CEILING = 2.0
GRAD_CEILING = 8.0
# The loss's reference is the trend, or the lowest of the last RECENT accepted losses when that
# is higher: where a falling curve flattens, the straight line undershoots for a few steps and
# an ordinary batch would look 1.3x above it.
RECENT = 3


@dataclass(frozen=True, slots=True)
class Judgement:
    """One step's verdict and the numbers behind it (None where a witness had nothing to say).

    loss_trend: the loss the trend expected; loss_z: how far above it, in robust standard
    deviations of the forecast errors; grad_trend, grad_ratio, grad_z: the same for the grad
    norm."""
    reason: str | None
    loss_trend: float | None = None
    loss_z: float | None = None
    grad_trend: float | None = None
    grad_ratio: float | None = None
    grad_z: float | None = None
    # log(value) - log(trend): what `observe` records when the step is accepted
    loss_error: float | None = None
    grad_error: float | None = None


def resistant_line(ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of Tukey's resistant line through (i, ys[i]): the slope joins the
    medians of the first and last thirds; the intercept is the median of y - slope * x."""
    n = len(ys)
    third = n // 3
    if third == 0:
        return 0.0, statistics.median(ys)
    left = statistics.median(ys[:third])
    right = statistics.median(ys[n - third:])
    # the x medians of the two thirds lie n - third steps apart
    slope = (right - left) / (n - third)
    return slope, statistics.median(y - slope * x for x, y in enumerate(ys))


def forecast(values: Sequence[float]) -> float | None:
    """The logarithm the trend of `values` expects next, or None (too few values, or one not
    positive)."""
    if len(values) < TREND_POINTS or min(values) <= 0:
        return None
    logs = [math.log(v) for v in values]
    slope, intercept = resistant_line(logs)
    return intercept + slope * len(logs)


def robust_z(error: float, errors: Sequence[float]) -> float:
    center = statistics.median(errors)
    mad = statistics.median(abs(e - center) for e in errors)
    return (error - center) / max(MAD_TO_STD * mad, NOISE_FLOOR)


class _Witness:
    """One value's trend (the last `window` accepted values) and noise (the forecast errors of
    the last ERROR_WINDOWS x `window` accepted steps)."""

    def __init__(self, window: int):
        self.values: deque[float] = deque(maxlen=window)
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOWS * window)

    def look(self, x: float) -> tuple[float | None, float | None, float | None]:
        """(trend, error, z) of x; None where there is nothing to judge by yet."""
        log = forecast(self.values) if x > 0 else None
        if log is None:
            return None, None, None
        error = math.log(x) - log
        z = robust_z(error, self.errors) if self.errors else None
        return math.exp(log), error, z

    def accept(self, x: float, error: float | None) -> None:
        if error is not None:
            self.errors.append(error)
        self.values.append(x)


class Guard:
    """Judges one step at a time; `observe` records the accepted ones."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self._loss = _Witness(cfg.window)
        self._grad = _Witness(cfg.window)

    def observe(self, loss: float, grad_norm: float) -> str | None:
        """The reason to skip this step, or None: then the values join the history."""
        j = self.judge(loss, grad_norm)
        if j.reason is None:
            self._loss.accept(loss, j.loss_error)
            self._grad.accept(grad_norm, j.grad_error)
        return j.reason

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        return self.judge(loss, grad_norm).reason

    def judge(self, loss: float, grad_norm: float) -> Judgement:
        """The verdict on this step and why, without recording anything."""
        if not math.isfinite(loss):
            return Judgement("nonfinite_loss")
        if not math.isfinite(grad_norm):
            return Judgement("nonfinite_grad_norm")
        trend, error, z = self._loss.look(loss)
        g_trend, g_error, g_z = self._grad.look(grad_norm)
        ratio = None if g_trend is None else grad_norm / g_trend
        j = dict(loss_trend=trend, loss_z=z, grad_trend=g_trend, grad_ratio=ratio, grad_z=g_z,
                 loss_error=error, grad_error=g_error)
        if len(self._loss.values) < self.cfg.min_history or math.isinf(self.cfg.threshold):
            return Judgement(None, **j)
        bar = self.cfg.threshold
        reference = None if trend is None else max(trend, min(list(self._loss.values)[-RECENT:]))
        loss_big = z is not None and loss >= self.cfg.loss_ratio * reference
        if loss_big and (z > bar or loss >= LOSS_CEILING * reference):
            return Judgement("loss_spike", **j)
        if (loss_big and z > JOINT_SHARE * bar and g_z is not None
                and g_z > JOINT_SHARE * bar and ratio >= JOINT_GRAD_RATIO):
            return Judgement("loss_spike", **j)
        if g_z is not None and ratio >= self.cfg.grad_ratio and (
                g_z > GRAD_Z_FACTOR * bar or ratio >= GRAD_CEILING):
            return Judgement("grad_norm_spike", **j)
        return Judgement(None, **j)

    def state_dict(self) -> dict:
        """JSON-able; floats survive a JSON round trip exactly."""
        return {"loss": list(self._loss.values), "grad_norm": list(self._grad.values),
                "loss_errors": list(self._loss.errors), "grad_errors": list(self._grad.errors)}

    def load_state_dict(self, state: dict) -> None:
        # A shorter window in the resumed job keeps the newest steps (deque maxlen).
        for witness, values, errors in ((self._loss, "loss", "loss_errors"),
                                        (self._grad, "grad_norm", "grad_errors")):
            witness.values.clear()
            witness.errors.clear()
            kept = list(map(float, state[values]))
            if errors in state:
                witness.values.extend(kept)
                witness.errors.extend(map(float, state[errors]))
            else:
                # A checkpoint of an older guard: what the stored history can still tell,
                # each value against the trend of the ones before it.
                for x in kept:
                    witness.accept(x, witness.look(x)[1])
