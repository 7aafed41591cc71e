"""A rank's start line (trainer/train.py: StartTimes): where the time from the agent's
hand-over to the first step done went, the hand-over itself included -- a parked worker still
warming up when the round came reads its assignment late, and that wait is part of the
recovery (measured here: up to 2.3 s of a 2.8 s start)."""

from __future__ import annotations

import time

import pytest

from lazarus.trainer.rankprocess import RankProcess
from lazarus.trainer.train import StartTimes


def test_the_handover_is_a_phase_of_its_own_and_the_total_counts_it():
    now = time.perf_counter()
    start = StartTimes(began=now - 2.0, handed=now - 0.5)  # the worker took it 1.5 s late
    for phase in StartTimes.PHASES[2:]:
        start.mark(phase)
    row = start.row(round_=3, step=19, source="memory")
    assert row["handover_s"] == pytest.approx(1.5, abs=0.01)
    assert row["rendezvous_s"] == pytest.approx(0.5, abs=0.05)
    assert row["total_s"] == pytest.approx(sum(row[f"{p}_s"] for p in StartTimes.PHASES),
                                           abs=1e-5)
    assert row["total_s"] >= 2.0
    # wall-clock times, to line the start up with the agents' and the daemon's logs
    assert row["done_at"] - row["began_at"] == pytest.approx(row["total_s"], abs=0.002)
    assert abs(row["done_at"] - time.time()) < 5
    line = StartTimes.line(row)
    assert line.startswith("round 3 from memory at step 19: first step done 2.")
    assert "(handover 1.50 s, rendezvous 0.5" in line
    assert "entered" not in line  # no collective of the whole world marked


def test_the_world_collectives_a_start_entered_are_dated():
    """Where a survivor waits on a rank still starting (the scale bench reads them)."""
    start = StartTimes(began=time.perf_counter())
    start.entering()
    for phase in StartTimes.PHASES[2:]:
        start.mark(phase)
    row = start.row(round_=2, step=8, source="kept", in_place=True)
    (at,) = row["entered_at"]
    assert row["began_at"] - 0.01 <= at <= row["done_at"] + 0.01
    assert StartTimes.line(row).endswith(f"; world collectives entered at {at:.3f}")


def test_a_survivors_handover_says_when_it_let_go_and_when_the_assignment_came():
    """The scale bench splits a survivor's hand-over into its letting the last round go, the
    agent's message and its taking it (docs/scale.md)."""
    now, wall = time.perf_counter(), time.time()
    start = StartTimes(began=now - 1.0, handed=now)
    start.survived(RankProcess(noticed_at=wall - 0.8, left_at=wall - 0.6,
                               resumed_at=wall - 0.2))
    start.entering()
    for phase in StartTimes.PHASES[1:]:
        start.mark(phase)
    row = start.row(round_=4, step=20, source="kept", in_place=True)
    assert row["left_at"] == pytest.approx(wall - 0.6, abs=0.001)
    assert row["resumed_at"] == pytest.approx(wall - 0.2, abs=0.001)
    line = StartTimes.line(row)
    assert f"; world collectives entered at {row['entered_at'][0]:.3f}; handed over: a peer seen " \
           f"gone at {wall - 0.8:.3f}, issued at {row['began_at']:.3f}, the last round let go at {wall - 0.6:.3f}, the assignment " \
           f"came at {wall - 0.2:.3f}" in line
    # a first start (no round survived) says none of it
    fresh = StartTimes(began=now)
    fresh.survived(RankProcess())
    assert "handed over" not in StartTimes.line(fresh.row(round_=1, step=0, source="scratch"))


def test_without_a_handover_time_the_clock_starts_at_the_rank():
    start = StartTimes(began=time.perf_counter())
    for phase in StartTimes.PHASES[2:]:
        start.mark(phase)
    row = start.row(round_=1, step=0, source="scratch")
    assert row["handover_s"] == 0.0
    assert "handover 0.00 s" in StartTimes.line(row)


def test_a_handover_from_a_clock_gone_backwards_counts_as_none():
    now = time.perf_counter()
    start = StartTimes(began=now, handed=now - 3.0)
    assert start.seconds["handover"] == 0.0
