"""The checkpoint stall line (lazarus.core.stall): its shape, and a run's summary per tier."""

import pytest

from lazarus.core.stall import CheckpointStall, StallError, by_tier, is_step


def stall(step: int, blocked: float, durable: float | None, tier: str = "storage"):
    return CheckpointStall(step=step, tier=tier, blocked_s=blocked, durable_s=durable)


def test_a_line_round_trips_and_is_not_a_step():
    s = CheckpointStall(step=20, tier="memory", blocked_s=0.0125, durable_s=None, ranks=8)
    row = s.to_row()
    assert row == {"kind": "checkpoint", "step": 20, "tier": "memory", "blocked_s": 0.0125,
                   "durable_s": None, "ranks": 8}
    assert CheckpointStall.from_row(row) == s
    assert not is_step(row) and is_step({"step": 20, "loss": 1.0})


@pytest.mark.parametrize("row, message", [
    ({"step": "3", "tier": "storage", "blocked_s": 1, "durable_s": 1}, "step must be an integer"),
    ({"step": 3, "tier": "disk", "blocked_s": 1, "durable_s": 1}, "tier 'disk' is not one of"),
    ({"step": 3, "tier": "storage", "blocked_s": -1, "durable_s": 1}, "blocked_s must be"),
    ({"step": 3, "tier": "storage", "blocked_s": 1, "durable_s": "x"}, "durable_s must be"),
    ({"step": 3, "tier": "storage", "blocked_s": 1, "durable_s": 1, "ranks": 0}, "ranks must"),
])
def test_a_bad_line_is_named(row, message):
    with pytest.raises(StallError, match=message):
        CheckpointStall.from_row(row)


def test_summary_per_tier():
    # every 4 steps, a restore from 8 redoes 9-12 (12 saved again), the run's last step is 14;
    # the save of step 8 was never committed.
    stalls = [stall(4, 0.1, 0.5), stall(8, 0.3, None), stall(12, 0.2, 0.9),
              stall(12, 0.4, 0.7), stall(14, 0.1, 0.6), stall(5, 0.01, 0.02, "memory")]
    tiers = by_tier(stalls)
    assert list(tiers) == ["storage", "memory"]
    t = tiers["storage"]
    assert (t.count, t.committed, t.every) == (5, 4, 4)
    assert (t.blocked_median_s, t.blocked_max_s) == (0.2, 0.4)
    assert t.blocked_total_s == pytest.approx(1.1)
    assert t.durable_median_s == pytest.approx(0.65) and t.durable_max_s == 0.9
    m = tiers["memory"]
    assert (m.count, m.every, m.durable_median_s) == (1, None, 0.02)
