"""The step guard: which steps it rejects, what it remembers, and what a bad policy says."""

from __future__ import annotations

import json
import math
import random

import pytest

from lazarus.core.errors import UserError
from lazarus.core.trainconfig import GuardConfig, TrainConfig
from lazarus.trainer.guard import Guard


def noisy(n: int, *, seed: int = 0, loss: float = 3.0, grad_norm: float = 1.5) -> list[tuple[float, float]]:
    """A healthy run: a few percent of gaussian noise on a flat loss and gradient norm."""
    rng = random.Random(seed)
    return [(loss * (1 + 0.03 * rng.gauss(0, 1)), grad_norm * (1 + 0.1 * rng.gauss(0, 1))) for _ in range(n)]


def warmed(cfg: GuardConfig | None = None, n: int = 60) -> Guard:
    guard = Guard(cfg or GuardConfig(window=50, min_history=20))
    for loss, gn in noisy(n):
        assert guard.observe(loss, gn) is None
    return guard


def test_healthy_noise_is_never_flagged():
    guard = Guard(GuardConfig(window=50, min_history=10))
    verdicts = [guard.observe(loss, gn) for loss, gn in noisy(2000, seed=1)]
    assert verdicts.count(None) == 2000


@pytest.mark.parametrize("loss, grad_norm, reason", [
    (math.nan, 1.5, "nonfinite_loss"),
    (math.inf, 1.5, "nonfinite_loss"),
    (3.0, math.nan, "nonfinite_grad_norm"),
    (3.0, -math.inf, "nonfinite_grad_norm"),
])
def test_nan_and_inf_are_skipped_from_the_first_step(loss, grad_norm, reason):
    guard = Guard(GuardConfig())
    assert guard.observe(loss, grad_norm) == reason
    assert guard.state_dict() == {"loss": [], "grad_norm": []}


def test_a_spike_after_min_history_is_flagged_and_drops_are_not():
    guard = warmed()
    assert guard.observe(6.0, 1.5) == "loss_spike"           # twice the loss
    assert guard.observe(3.0, 15.0) == "grad_norm_spike"     # ten times the norm
    assert guard.observe(3.0, 6.0) is None                   # four times: healthy, see below
    assert guard.observe(9.0, 9.0) == "loss_spike"           # both: the loss is named first
    assert guard.observe(3.3, 1.9) is None                   # within the noise
    assert guard.observe(0.5, 0.01) is None                  # one-sided: a drop is not a failure


def test_threshold_is_a_robust_zscore():
    # History: 1.0, 2.0, ..., 9.0 -> median 5, MAD 2, scale 1.4826 * 2.
    guard = Guard(GuardConfig(window=9, min_history=9, threshold=3.0))
    for v in range(1, 10):
        assert guard.observe(float(v), 1.0) is None
    bar = 5 + 3.0 * 1.4826 * 2
    assert guard.verdict(bar - 0.01, 1.0) is None
    assert guard.verdict(bar + 0.01, 1.0) == "loss_spike"


def test_a_flat_history_has_a_one_percent_noise_floor():
    guard = Guard(GuardConfig(window=10, min_history=5, threshold=6.0))
    for _ in range(10):
        guard.observe(2.0, 1.0)
    # MAD is 0: the scale is 1% of the median, so the bar is 2.0 * (1 + 6 * 0.01).
    assert guard.verdict(2.11, 1.0) is None
    assert guard.verdict(2.13, 1.0) == "loss_spike"


def test_nothing_but_nonfinite_values_is_judged_before_min_history():
    guard = Guard(GuardConfig(window=50, min_history=20))
    for loss, gn in noisy(19):
        guard.observe(loss, gn)
    assert guard.observe(100.0, 100.0) is None      # 19 accepted steps: too early to judge
    assert guard.observe(math.nan, 1.0) == "nonfinite_loss"
    assert guard.observe(100.0, 100.0) == "loss_spike"  # the 20 accepted steps include the 100


def test_skipped_steps_never_enter_the_history():
    guard = warmed()
    before = guard.state_dict()
    # A persistent blow-up stays flagged on every step: it never raises its own bar.
    for _ in range(30):
        assert guard.observe(8.0, 20.0) == "loss_spike"
    assert guard.observe(math.inf, 1.0) == "nonfinite_loss"
    assert guard.state_dict() == before


def test_history_is_the_last_window_accepted_steps():
    guard = Guard(GuardConfig(window=5, min_history=5))
    for i in range(8):
        guard.observe(3.0 + i / 100, 1.0 + i / 100)
    assert guard.state_dict()["loss"] == [3.03, 3.04, 3.05, 3.06, 3.07]


def test_state_round_trips_through_json_and_judges_alike():
    series = noisy(80, seed=2) + [(7.0, 1.5), (3.1, 1.6), (3.0, 15.0)] + noisy(40, seed=3)
    straight = Guard(GuardConfig(window=30, min_history=10))
    verdicts = [straight.observe(*v) for v in series]

    first = Guard(GuardConfig(window=30, min_history=10))
    for v in series[:70]:
        first.observe(*v)
    resumed = Guard(GuardConfig(window=30, min_history=10))
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.observe(*v) for v in series[70:]] == verdicts[70:]
    assert verdicts[80:83] == ["loss_spike", None, "grad_norm_spike"]
    assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize("settings, message", [
    ({"window": 0}, "guard.window must be at least 1, got 0"),
    ({"window": -5}, "guard.window must be at least 1, got -5"),
    ({"threshold": 1.0}, "guard.threshold must be greater than 1"),
    ({"threshold": 0.5}, "guard.threshold must be greater than 1"),
    ({"threshold": math.nan}, "guard.threshold must be greater than 1"),
    ({"min_history": 0}, r"guard.min_history must be between 1 and guard.window \(50\), got 0"),
    ({"min_history": 60}, r"guard.min_history must be between 1 and guard.window \(50\), got 60"),
    ({"grad_ratio": 0.5}, "guard.grad_ratio must be at least 1, got 0.5"),
])
def test_bad_policy_is_a_user_error_naming_the_setting(settings, message):
    with pytest.raises(UserError, match=message):
        GuardConfig(**settings)
    with pytest.raises(UserError, match=message):
        TrainConfig.from_dict({"guard": settings})


def test_an_infinite_threshold_keeps_only_the_nonfinite_check():
    guard = warmed(GuardConfig(window=50, min_history=20, threshold=math.inf))
    assert guard.observe(1e6, 1e6) is None
    assert guard.observe(math.nan, 1.0) == "nonfinite_loss"
    cfg = TrainConfig.from_dict({"guard": {"threshold": math.inf, "window": 8, "min_history": 4}})
    assert cfg.guard == GuardConfig(threshold=math.inf, window=8, min_history=4)


def test_a_healthy_gradient_norm_that_triples_is_no_spike():
    # Measured on the tiny model (seq 512, batch 32): the loss flat at ~2.45 while the
    # gradient norm went from ~0.7 to ~3 within 15 steps. The loss z-score alone stays quiet.
    guard = Guard(GuardConfig(window=50, min_history=8))
    for loss, gn in noisy(60, loss=2.45, grad_norm=0.7, seed=4):
        assert guard.observe(loss, gn) is None
    rising = [1.7, 1.2, 2.3, 2.4, 1.5, 2.3, 2.8, 2.9, 2.8, 3.0, 2.4, 2.2, 1.6, 1.7, 3.3, 3.3]
    assert [guard.observe(2.45, gn) for gn in rising] == [None] * len(rising)
