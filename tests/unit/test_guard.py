"""The step guard: which steps it rejects, what it remembers, and what a bad policy says."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus.core.errors import UserError
from lazarus.core.trainconfig import GuardConfig, TrainConfig
from lazarus.trainer.guard import Guard, forecast, resistant_line, robust_z

# `lazarus train --model tiny --global-batch 8 --seq-len 64 --nproc 2 --warmup-steps 10`
# (the shape `lazarus up` runs) with loss-spike@10,diverge@25 and the guard off: (loss, grad
# norm) of steps 1-30. Step 10 and steps 25-29 trained on poisoned batches. The guard this
# one replaced let step 10 and four of the five diverging steps through: its median and MAD
# over a history that fell from 5.7 to 4.4 put the bar above them.
ISSUE_13_RUN = [
    (5.747, 16.757), (5.673, 16.155), (5.498, 12.924), (5.274, 10.954), (4.531, 12.028),
    (4.365, 7.399), (4.457, 4.900), (4.660, 5.309), (4.358, 4.477), (5.836, 27.691),
    (4.156, 2.868), (3.562, 7.714), (3.869, 3.466), (4.074, 2.861), (3.749, 2.214),
    (3.409, 2.344), (3.803, 3.145), (3.422, 2.035), (3.556, 2.249), (3.795, 4.741),
    (3.508, 3.709), (3.129, 2.012), (3.068, 2.097), (3.451, 2.484), (6.580, 24.953),
    (7.293, 36.954), (6.602, 35.155), (5.935, 23.867), (5.789, 28.320), (3.265, 2.335),
]
POISONED = {10, 25, 26, 27, 28, 29}


def noisy(n: int, *, seed: int = 0, loss: float = 3.0, grad_norm: float = 1.5,
          decay: float = 0.0) -> list[tuple[float, float]]:
    """A healthy run: a few percent of gaussian noise on a loss that falls by `decay` per step
    (relative) and a flat gradient norm."""
    rng = random.Random(seed)
    return [(loss * math.exp(-decay * i) * (1 + 0.03 * rng.gauss(0, 1)),
             grad_norm * (1 + 0.1 * rng.gauss(0, 1))) for i in range(n)]


def warmed(cfg: GuardConfig | None = None, n: int = 60, **kw) -> Guard:
    guard = Guard(cfg or GuardConfig())
    for loss, gn in noisy(n, **kw):
        assert guard.observe(loss, gn) is None
    return guard


def test_the_run_of_issue_13_skips_exactly_the_poisoned_steps():
    guard = Guard(GuardConfig())
    skipped = {step for step, (loss, gn) in enumerate(ISSUE_13_RUN, 1) if guard.observe(loss, gn)}
    assert skipped == POISONED


def test_a_spike_early_in_a_falling_loss_is_caught():
    # Loss falling 4% a step: at step 12 the median of the history (step 6's loss) is 27%
    # above the trend, so a spike of 1.35x the trend is only 6% above that median. A bar
    # counted from the median passes it; this one does not.
    guard = Guard(GuardConfig())
    for loss, gn in noisy(11, loss=5.0, decay=0.04, seed=3):
        assert guard.observe(loss, gn) is None
    trend = 5.0 * math.exp(-0.04 * 11)
    assert guard.verdict(trend, 1.5) is None
    assert guard.verdict(1.05 * trend, 1.5) is None
    assert 1.35 * trend < 1.07 * 5.0 * math.exp(-0.04 * 5)
    assert guard.verdict(1.35 * trend, 1.5) == "loss_spike"


def test_healthy_noise_is_never_flagged():
    for decay in (0.0, 0.002):
        guard = Guard(GuardConfig())
        verdicts = [guard.observe(loss, gn) for loss, gn in noisy(2000, seed=1, decay=decay)]
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
    assert guard.state_dict() == {"loss": [], "grad_norm": [], "loss_errors": [], "grad_errors": []}


def test_spikes_are_flagged_and_drops_are_not():
    guard = warmed()
    assert guard.observe(6.0, 1.5) == "loss_spike"           # twice the loss
    assert guard.observe(3.0, 30.0) == "grad_norm_spike"     # twenty times the norm
    assert guard.observe(3.0, 6.0) is None                   # four times: healthy, see below
    assert guard.observe(9.0, 9.0) == "loss_spike"           # both: the loss is named first
    assert guard.observe(3.1, 1.9) is None                   # within the noise
    assert guard.observe(0.5, 0.01) is None                  # one-sided: a drop is not a failure


def test_resistant_line_ignores_outliers():
    assert resistant_line([1.0, 3.0, 5.0, 7.0, 9.0, 11.0]) == (2.0, 1.0)
    # one wild point in each third moves neither the slope nor the intercept
    line = [1.0 + 2.0 * x for x in range(15)]
    line[4], line[7], line[10] = 1000.0, 500.0, -1000.0
    assert resistant_line(line) == (2.0, 1.0)
    assert resistant_line([4.0, 2.0]) == (0.0, 3.0)


def test_forecast_extends_the_trend_in_logarithms():
    losses = [4.0 * math.exp(-0.05 * i) for i in range(10)]
    assert forecast(losses) == pytest.approx(math.log(4.0) - 0.05 * 10)
    assert forecast(losses[:2]) is None      # too short for a trend
    assert forecast([1.0, 0.0, 2.0]) is None  # not positive: no logarithm


def test_robust_z_is_the_distance_in_mad_units_with_a_floor():
    errors = [-0.2, -0.1, 0.0, 0.1, 0.2]  # median 0, MAD 0.1
    assert robust_z(0.3, errors) == pytest.approx(0.3 / (1.4826 * 0.1))
    assert robust_z(0.05, [0.0] * 5) == pytest.approx(5.0)   # MAD 0: 1% floor


def test_a_spike_is_at_least_loss_ratio_times_the_trend():
    # A loss falling exactly exponentially: every forecast is exact, the errors are 0, so the
    # spread is the 1% floor and any rise is far beyond the noise: the size bar decides. Its
    # reference is the lowest of the last 3 losses here (above the falling line).
    guard = Guard(GuardConfig(window=20, loss_ratio=1.3))
    for i in range(20):
        assert guard.observe(4.0 * math.exp(-0.05 * i), 1.0) is None
    trend = 4.0 * math.exp(-0.05 * 20)
    reference = 4.0 * math.exp(-0.05 * 19)
    assert guard.judge(trend, 1.0).loss_trend == pytest.approx(trend)
    assert guard.judge(1.29 * reference, 1.0).loss_z > 20
    assert guard.verdict(1.29 * reference, 1.0) is None
    assert guard.verdict(1.31 * reference, 1.0) == "loss_spike"


def test_where_a_falling_curve_flattens_the_last_losses_are_the_reference():
    # Falling 5% a step, then flat: the line through the last 20 forecasts a loss well below
    # the flat level, and an ordinary batch would be 1.3x above it.
    guard = Guard(GuardConfig())
    history = [4.0 * math.exp(-0.05 * i) for i in range(15)] + [4.0 * math.exp(-0.05 * 14)] * 5
    for loss in history:
        assert guard.observe(loss, 1.0) is None
    flat = history[-1]
    assert guard.judge(flat, 1.0).loss_trend < flat / 1.1
    assert guard.verdict(1.25 * flat, 1.0) is None
    assert guard.verdict(1.35 * flat, 1.0) == "loss_spike"


def test_a_loss_within_the_runs_own_noise_is_no_spike():
    # 20% noise (a run of tiny batches): 1.6x the trend is an odd batch of this run, not a
    # spike; the bar is `threshold` robust standard deviations of its forecast errors.
    guard = Guard(GuardConfig())
    rng = random.Random(7)
    for _ in range(200):
        assert guard.observe(3.0 * math.exp(0.2 * rng.gauss(0, 1)), 1.5) is None
    trend = guard.judge(3.0, 1.5).loss_trend
    odd = guard.judge(1.6 * trend, 1.5)
    assert odd.reason is None and odd.loss_z < 5
    far = guard.judge(4.0 * trend, 1.5)
    assert far.reason == "loss_spike" and far.loss_z > 5


def test_two_witnesses_together_need_less_than_either_alone():
    # The same odd loss, with the gradient norm 3x its trend as well: a bad batch moves both,
    # healthy noise rarely does.
    guard = Guard(GuardConfig())
    rng = random.Random(8)
    for _ in range(200):
        assert guard.observe(3.0 * math.exp(0.1 * rng.gauss(0, 1)),
                             1.5 * math.exp(0.1 * rng.gauss(0, 1))) is None
    loss = guard.judge(3.0, 1.5).loss_trend * 1.6
    grad = guard.judge(3.0, 1.5).grad_trend * 3.0
    assert guard.judge(loss, 1.5).reason is None          # the loss alone: z ~3.5, under 5
    assert guard.judge(3.0, grad).reason is None          # the grad norm alone: under 5x
    both = guard.judge(loss, grad)
    assert both.reason == "loss_spike" and both.loss_z < 5, both


def test_grad_norm_is_judged_against_its_own_trend():
    # Gradient norms falling fast, as in a run's first steps: 5x the trend is a spike, though
    # it is less than 3x the median of the last 8 steps.
    guard = Guard(GuardConfig(window=20))
    for i in range(12):
        assert guard.observe(3.0, 16.0 * math.exp(-0.15 * i)) is None
    trend = 16.0 * math.exp(-0.15 * 12)
    j = guard.judge(3.0, 5.01 * trend)
    assert (j.reason, j.grad_ratio) == ("grad_norm_spike", pytest.approx(5.01))
    assert 5.01 * trend < 3 * statistics.median(16.0 * math.exp(-0.15 * i) for i in range(4, 12))
    assert guard.verdict(3.0, 4.9 * trend) is None


def test_nothing_but_nonfinite_values_is_judged_before_min_history():
    guard = Guard(GuardConfig(window=20, min_history=10))
    for loss, gn in noisy(9):
        guard.observe(loss, gn)
    assert guard.observe(100.0, 100.0) is None      # 9 accepted steps: too early to judge
    assert guard.observe(math.nan, 1.0) == "nonfinite_loss"
    assert guard.observe(300.0, 1.5) == "loss_spike"


def test_a_witness_without_positive_values_abstains():
    guard = warmed()
    assert guard.verdict(-1.0, 1.5) is None and guard.verdict(0.0, 1.5) is None
    assert guard.verdict(3.0, 0.0) is None
    assert guard.observe(3.0, 0.0) is None           # a zero grad norm joins the history ...
    assert guard.verdict(3.0, 100.0) is None         # ... and the grad witness abstains
    assert guard.verdict(30.0, 1.5) == "loss_spike"  # the loss still judges


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
    state = guard.state_dict()
    assert state["loss"] == [3.03, 3.04, 3.05, 3.06, 3.07]
    assert len(state["loss_errors"]) == 5


def test_state_round_trips_through_json_and_judges_alike():
    series = noisy(80, seed=2) + [(7.0, 1.5), (3.1, 1.6), (3.0, 30.0)] + noisy(40, seed=3)
    straight = Guard(GuardConfig(window=30, min_history=10))
    verdicts = [straight.observe(*v) for v in series]

    first = Guard(GuardConfig(window=30, min_history=10))
    for v in series[:70]:
        first.observe(*v)
    resumed = Guard(GuardConfig(window=30, min_history=10))
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.observe(*v) for v in series[70:]] == verdicts[70:]
    assert verdicts[80:83] == ["loss_spike", None, "grad_norm_spike"], verdicts[80:83]
    assert resumed.state_dict() == straight.state_dict()


def test_a_checkpoint_from_before_forecast_errors_loads():
    # The guard's state used to be {"loss", "grad_norm"}. While the history has not filled its
    # window, the errors rebuilt from it are the ones the run recorded.
    guard = Guard(GuardConfig())
    for loss, gn in noisy(15, seed=5):
        guard.observe(loss, gn)
    state = guard.state_dict()
    old = Guard(GuardConfig())
    old.load_state_dict({"loss": state["loss"], "grad_norm": state["grad_norm"]})
    assert old.state_dict() == state


@pytest.mark.parametrize("settings, message", [
    ({"window": 2}, "guard.window must be at least 3, got 2"),
    ({"window": -5}, "guard.window must be at least 3, got -5"),
    ({"threshold": 1.0}, "guard.threshold must be greater than 1"),
    ({"threshold": 0.5}, "guard.threshold must be greater than 1"),
    ({"threshold": math.nan}, "guard.threshold must be greater than 1"),
    ({"min_history": 3}, r"guard.min_history must be between 4 and guard.window \(20\), got 3"),
    ({"min_history": 60}, r"guard.min_history must be between 4 and guard.window \(20\), got 60"),
    ({"grad_ratio": 1.0}, "guard.grad_ratio must be greater than 1, got 1.0"),
    ({"grad_ratio": math.nan}, "guard.grad_ratio must be greater than 1, got nan"),
    ({"loss_ratio": 0.9}, "guard.loss_ratio must be greater than 1, got 0.9"),
])
def test_bad_policy_is_a_user_error_naming_the_setting(settings, message):
    with pytest.raises(UserError, match=message):
        GuardConfig(**settings)
    with pytest.raises(UserError, match=message):
        TrainConfig.from_dict({"guard": settings})


def test_an_infinite_threshold_keeps_only_the_nonfinite_check():
    guard = warmed(GuardConfig(threshold=math.inf))
    assert guard.observe(1e6, 1e6) is None
    assert guard.observe(math.nan, 1.0) == "nonfinite_loss"
    cfg = TrainConfig.from_dict({"guard": {"threshold": math.inf, "window": 8, "min_history": 4}})
    assert cfg.guard == GuardConfig(threshold=math.inf, window=8, min_history=4)


def test_a_healthy_gradient_norm_that_triples_is_no_spike():
    # Measured on the tiny model (seq 512, batch 32): the loss flat at ~2.45 while the
    # gradient norm went from ~0.7 to ~3 within 15 steps.
    guard = Guard(GuardConfig())
    for loss, gn in noisy(60, loss=2.45, grad_norm=0.7, seed=4):
        assert guard.observe(loss, gn) is None
    rising = [1.7, 1.2, 2.3, 2.4, 1.5, 2.3, 2.8, 2.9, 2.8, 3.0, 2.4, 2.2, 1.6, 1.7, 3.3, 3.3]
    assert [guard.observe(2.45, gn) for gn in rising] == [None] * len(rising)


values = st.floats(min_value=0.5, max_value=20.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(values, values), min_size=8, max_size=40), st.tuples(values, values),
       st.floats(min_value=1e-3, max_value=1e3), st.floats(min_value=1e-3, max_value=1e3))
def test_verdicts_do_not_depend_on_units(history, step, loss_unit, grad_unit):
    # The trends live in logarithms: a loss in other units (or a gradient norm of a model
    # scaled otherwise) is judged alike, up to rounding right at a bar.
    cfg = GuardConfig()
    plain, scaled = Guard(cfg), Guard(cfg)
    for loss, gn in history + [step]:
        a, b = plain.judge(loss, gn), scaled.judge(loss * loss_unit, gn * grad_unit)
        assert (a.loss_z is None, a.grad_ratio is None) == (b.loss_z is None, b.grad_ratio is None)
        if a.loss_z is not None:
            assert b.loss_z == pytest.approx(a.loss_z, rel=1e-6, abs=1e-6)
            assert b.grad_ratio == pytest.approx(a.grad_ratio, rel=1e-9)
        if a.reason != b.reason:
            assert (abs(a.loss_z - cfg.threshold) < 1e-6
                    or abs(a.grad_ratio - cfg.grad_ratio) < 1e-9), (a, b)
            return
        plain.observe(loss, gn)
        scaled.observe(loss * loss_unit, gn * grad_unit)


def test_a_higher_value_is_never_judged_better():
    # The step is drawn around the history's last values, from well below to far above, so
    # that many examples are rejected: the property says nothing about the others.
    rejected = []

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.lists(st.tuples(values, values), min_size=8, max_size=40),
           st.tuples(st.floats(min_value=0.5, max_value=10.0),
                     st.floats(min_value=0.5, max_value=10.0)),
           st.floats(min_value=1.0, max_value=100.0))
    def higher(history, scale, factor):
        guard = Guard(GuardConfig())
        for loss, gn in history:
            guard.observe(loss, gn)
        loss, gn = history[-1][0] * scale[0], history[-1][1] * scale[1]
        if guard.verdict(loss, gn) is not None:
            rejected.append((loss, gn))
            assert guard.verdict(loss * factor, gn) is not None
            assert guard.verdict(loss, gn * factor) is not None

    higher()
    assert len(rejected) >= 10, rejected


def test_ceilings_hold_in_a_run_wild_from_its_first_steps():
    # A learning rate far too high: the run's own noise is huge, so no z stands out; a loss 2x
    # its reference or a gradient norm 8x its trend is still a spike.
    guard = Guard(GuardConfig())
    rng = random.Random(9)
    for _ in range(100):
        guard.observe(3.0 * math.exp(0.3 * rng.gauss(0, 1)), 1.5 * math.exp(0.6 * rng.gauss(0, 1)))
    j = guard.judge(3.0, 1.5)
    assert math.exp(5 * 0.3) > 2 and math.exp(3 * 5 * 0.6) > 8   # the noise bars lie beyond
    reference = max(j.loss_trend, min(guard.state_dict()["loss"][-3:]))
    assert guard.judge(1.9 * reference, 1.5).reason is None
    assert guard.judge(2.0 * reference, 1.5).reason == "loss_spike"
    assert guard.judge(2.0, 7.5 * j.grad_trend).reason is None
    assert guard.judge(2.0, 8.0 * j.grad_trend).reason == "grad_norm_spike"
