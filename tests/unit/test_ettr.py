"""The ETTR model (lazarus.core.ettr) against numbers worked out by hand."""

import math

import pytest

from lazarus.core.ettr import Tier, expected_ettr, job_mtbf_s, young_interval_s


def test_llama3_rate_scaled_to_the_run():
    # 54 days x 86,400 s x 16,384 GPUs / (419 x GPUs)
    assert job_mtbf_s(16384) == pytest.approx(4_665_600 / 419)          # 11,135.1 s: 3.1 h
    assert job_mtbf_s(2) == pytest.approx(4_665_600 / 419 * 8192)      # 1,055.8 days
    assert job_mtbf_s(8, interruptions=10, days=1, on_gpus=8) == pytest.approx(8640.0)


def test_one_tier_by_hand():
    # s = 1, every 100, c = 10, durable when the loop resumes: u = 1 / 1.1
    tier = Tier(every=100, blocked_s=10.0, durable_s=10.0)
    e = expected_ettr(step_s=1.0, tiers=[tier], restore_from=tier, restart_s=50.0,
                      mtbf_s=10_000.0)
    assert e.restarts == pytest.approx(0.005)                  # 50 / 10,000
    assert e.recomputation == pytest.approx(0.0055)            # (100 x 1.1 / 2) / 10,000
    assert e.ettr == pytest.approx(0.9895 / 1.1)               # 0.89955
    assert e.stalls == pytest.approx(0.9895 * 0.1 / 1.1)       # 0.08995
    assert e.ettr + e.stalls + e.recomputation + e.restarts == pytest.approx(1.0)
    assert e.optimal_every_s == pytest.approx(math.sqrt(200_000))   # 447.2 s
    assert e.optimal_every == 447


def test_a_checkpoint_not_yet_durable_costs_its_exposure():
    # async: the loop waits 1 s, the checkpoint is durable 21 s after it started: 20 s exposed
    tier = Tier(every=100, blocked_s=1.0, durable_s=21.0)
    e = expected_ettr(step_s=1.0, tiers=[tier], restore_from=tier, restart_s=0.0,
                      mtbf_s=10_000.0)
    assert e.recomputation == pytest.approx((100 * 1.01 / 2 + 20) / 10_000)   # 0.00705
    assert e.ettr == pytest.approx((1 - 0.00705) / 1.01)


def test_two_tiers_restoring_from_memory():
    storage = Tier(every=100, blocked_s=10.0, durable_s=10.0)
    memory = Tier(every=10, blocked_s=0.1, durable_s=0.5)
    e = expected_ettr(step_s=1.0, tiers=[storage, memory], restore_from=memory,
                      restart_s=20.0, mtbf_s=10_000.0)
    # u = 1 / (1 + 0.1 + 0.01); recomputation = (10 x 1.11 / 2 + 0.4) / 10,000
    assert e.recomputation == pytest.approx(0.000595)
    assert e.restarts == pytest.approx(0.002)
    assert e.ettr == pytest.approx(0.997405 / 1.11)
    assert e.optimal_every_s == pytest.approx(math.sqrt(2 * 0.1 * 10_000))   # 44.7 s: 45 steps
    assert e.optimal_every == 45


def test_failures_faster_than_progress_leave_nothing():
    tier = Tier(every=100, blocked_s=1.0, durable_s=1.0)
    e = expected_ettr(step_s=1.0, tiers=[tier], restore_from=tier, restart_s=100.0,
                      mtbf_s=60.0)
    assert e.ettr == 0 and e.stalls == 0
    assert e.restarts + e.recomputation == pytest.approx(1.0)


def test_no_stall_means_checkpoint_every_step():
    assert young_interval_s(0.0, 1000.0) == 0.0
    tier = Tier(every=5, blocked_s=0.0, durable_s=0.0)
    e = expected_ettr(step_s=2.0, tiers=[tier], restore_from=tier, restart_s=0.0, mtbf_s=1e6)
    assert e.optimal_every == 1 and e.stalls == 0
    assert e.recomputation == pytest.approx(5.0 / 1e6)   # half of 10 s of compute


@pytest.mark.parametrize("call, message", [
    (lambda: job_mtbf_s(0), "GPUs must be > 0"),
    (lambda: job_mtbf_s(8, interruptions=-1), "interruptions must be > 0, not -1"),
    (lambda: job_mtbf_s(8, days=math.nan), "days must be > 0"),
    (lambda: Tier(every=0, blocked_s=1, durable_s=1), "whole number of steps >= 1"),
    (lambda: Tier(every=3, blocked_s=-0.5, durable_s=1), "blocked time per checkpoint must be >= 0"),
    (lambda: young_interval_s(1.0, 0.0), "MTBF must be > 0"),
])
def test_bad_figures_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_restore_tier_must_be_the_runs():
    a, b = Tier(every=1, blocked_s=0, durable_s=0), Tier(every=2, blocked_s=0, durable_s=0)
    with pytest.raises(ValueError, match="one of the run's tiers"):
        expected_ettr(step_s=1, tiers=[a], restore_from=b, restart_s=0, mtbf_s=1)
