"""The automatic tier-0 period (lazarus.trainer.snapshot): one slow snapshot does not stretch
it, a sustained cost does, it lengthens only once a copy of the round is durable on the peer,
and a checkpoint step always takes a snapshot, so memory is never older than storage."""

from __future__ import annotations

import types

import pytest
import torch

from lazarus.trainer import snapshot
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer

FAST, SLOW = 0.0005, 0.05        # a snapshot's usual stall, and one outlier
STEP = 0.05                      # 1% of it: 0.5 ms, so FAST fits every step


@pytest.mark.parametrize("stalls, typical", [
    ([], None),
    ([FAST, FAST], None),                               # too few to judge
    ([FAST, FAST, FAST], FAST),
    ([FAST, FAST, SLOW, FAST, FAST], FAST),             # one outlier: the median holds
    ([SLOW, FAST, FAST, FAST, FAST, FAST], FAST),       # ... and it ages out of the window
    ([FAST, FAST, 0.002, 0.002, 0.002], 0.002),         # a sustained rise moves it
])
def test_the_typical_stall_is_the_median_of_the_recent_ones(stalls, typical):
    assert snapshot.typical_stall(stalls) == typical


@pytest.mark.parametrize("current, stalls, durable, replicated, want", [
    # no stall known yet: the period holds, and may not lengthen
    (1, [], [], True, (1, False)),
    # an outlier among usual stalls: every step still
    (1, [FAST, SLOW, FAST], [0.02], True, (1, True)),
    # a sustained 2 ms stall on a 50 ms step: every 4 steps
    (1, [0.002] * 5, [0.02], True, (4, True)),
    # the same before any copy of the round is durable: wished, but not to lengthen by
    (1, [0.002] * 5, [], False, (4, False)),
    # a copy that takes 3 steps to reach the peer: one in flight end to end
    (1, [FAST] * 3, [0.15], True, (3, True)),
])
def test_the_wished_period(current, stalls, durable, replicated, want):
    assert snapshot.wished_period(current=current, stalls=stalls, step_times=[STEP] * 5,
                                  durable_times=durable, replicated=replicated) == want


@pytest.mark.parametrize("current, wish, all_ready, period", [
    (1, 4, True, 4),
    (1, 4, False, 1),      # a rank without a durable copy holds it
    (6, 2, False, 2),      # shortening needs nobody's leave
    (6, 9, False, 6),
])
def test_the_agreed_period(current, wish, all_ready, period):
    assert snapshot.agree_period(current=current, wish=wish, all_ready=all_ready) == period


@pytest.mark.parametrize("step, next_step, checkpoint, due", [
    (25, 26, False, False),
    (25, 26, True, True),   # a checkpoint step: memory as new as storage
    (26, 26, False, True),
    (27, 26, False, True),
])
def test_a_checkpoint_step_is_always_snapshotted(step, next_step, checkpoint, due):
    assert snapshot.snapshot_due(step, next_step=next_step, checkpoint=checkpoint) is due


class _Clock:
    """perf_counter for `Snapshotter.take`: each take reads it twice (before and after the
    copy); the stall of the next take is whatever `stall` says."""

    def __init__(self):
        self.now, self.stall, self._first = 1000.0, FAST, True

    def perf_counter(self) -> float:
        if not self._first:
            self.now += self.stall
        self._first = not self._first
        return self.now

    monotonic = perf_counter

    @staticmethod
    def sleep(_s: float) -> None:
        pass


@pytest.fixture
def model_and_optimizer():
    torch.manual_seed(0)
    model = Transformer(get_model_config("tiny"))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    model(torch.randint(0, 100, (2, 16))).float().mean().backward()
    opt.step()
    return model, opt


def _snapshotter(tmp_path, monkeypatch, *, every: int, first_step: int, durable: bool = True,
                 settle: bool = True):
    clock = _Clock()
    monkeypatch.setattr(snapshot, "time", types.SimpleNamespace(
        perf_counter=clock.perf_counter, monotonic=clock.monotonic, sleep=clock.sleep))
    written: list[int] = []
    settled: list[tuple[int, bool, float]] = []

    def on_written(step: int, _path: str) -> None:
        written.append(step)
        if settle:  # the agent's answer: on the peer (or never), 20 ms after the start
            settled.append((step, durable, clock.now + 0.02))

    def kept():
        out, settled[:] = list(settled), []
        return out

    snaps = snapshot.Snapshotter(tmp_path, every=every, first_step=first_step,
                                 header={"job": "j", "round": 2, "rank": 0, "world_size": 1},
                                 on_written=on_written, kept=kept)
    return snaps, clock, written


def _run(snaps, clock, model, opt, steps, *, stall=lambda step: FAST, checkpoint=()):
    """The training loop's use of it: each step observed, snapshotted when due (always at a
    checkpoint step), its stalls read. Returns the steps snapshotted."""
    taken = []
    for step in steps:
        snaps.observe_step(STEP)
        if snaps.due(step, checkpoint=step in checkpoint):
            clock.stall = stall(step)
            snaps.take(step, model, opt, {"step": step})
            snaps.wait()  # written, so the agent's answer is in before the next step
            taken.append(step)
        snaps.stalls()
    return taken


def test_a_slow_first_snapshot_after_a_restart_does_not_stretch_the_period(
        tmp_path, monkeypatch, model_and_optimizer):
    # The demo's in-place recovery at step 12: the new round's first snapshot blocked 0.05 s
    # (fresh buffers) against 0.5 ms later. It went from every step to every 13.
    snaps, clock, _ = _snapshotter(tmp_path, monkeypatch, every=0, first_step=12)
    taken = _run(snaps, clock, *model_and_optimizer, range(13, 31),
                 stall=lambda step: SLOW if step == 13 else FAST)
    snaps.close()
    assert taken == list(range(13, 31))


def test_an_outlier_later_does_not_stretch_it_and_a_sustained_cost_does(
        tmp_path, monkeypatch, model_and_optimizer):
    snaps, clock, _ = _snapshotter(tmp_path, monkeypatch, every=0, first_step=0)
    taken = _run(snaps, clock, *model_and_optimizer, range(1, 11),
                 stall=lambda step: SLOW if step == 7 else FAST)
    assert taken == list(range(1, 11))
    # 2 ms, every snapshot from step 11: 4% of the step at every step; once the median of
    # the recent ones says so, every 4 steps
    taken = _run(snaps, clock, *model_and_optimizer, range(11, 40), stall=lambda step: 0.002)
    snaps.close()
    assert taken[:3] == [11, 12, 13]
    gaps = {b - a for a, b in zip(taken[3:], taken[4:])}
    assert gaps == {4}, taken


def test_the_period_does_not_lengthen_before_a_copy_of_the_round_is_durable(
        tmp_path, monkeypatch, model_and_optimizer):
    # The agent has not settled any copy yet (the replica of a rank started anew is not on
    # its peer): snapshots every step, however costly, until one is.
    snaps, clock, _ = _snapshotter(tmp_path, monkeypatch, every=0, first_step=0, settle=False)
    taken = _run(snaps, clock, *model_and_optimizer, range(1, 9), stall=lambda step: 0.002)
    assert taken == list(range(1, 9))
    snaps._pending.clear()
    snaps.close()


def test_a_peer_that_never_takes_a_copy_does_not_pin_the_period_to_every_step(
        tmp_path, monkeypatch, model_and_optimizer):
    snaps, clock, _ = _snapshotter(tmp_path, monkeypatch, every=0, first_step=0, durable=False)
    taken = _run(snaps, clock, *model_and_optimizer, range(1, 30), stall=lambda step: 0.002)
    snaps.close()
    assert taken[:snapshot.NEVER_DURABLE_LIMIT] == list(range(1, snapshot.NEVER_DURABLE_LIMIT + 1))
    assert taken[-1] - taken[-2] == 4, taken


@pytest.mark.parametrize("every", [0, 3])
def test_a_checkpoint_step_takes_a_snapshot_and_a_fixed_period_keeps_its_steps(
        tmp_path, monkeypatch, model_and_optimizer, every):
    snaps, clock, written = _snapshotter(tmp_path, monkeypatch, every=every, first_step=0)
    # A sustained cost: the automatic period lengthens past the checkpoint period (5).
    taken = _run(snaps, clock, *model_and_optimizer, range(1, 41), stall=lambda step: 0.01,
                 checkpoint={10, 20, 25, 40})
    snaps.close()
    assert {10, 20, 25, 40} <= set(taken) and set(written) == set(taken)
    if every:
        assert set(taken) == set(range(3, 41, 3)) | {10, 20, 25, 40}
    else:
        assert max(b - a for a, b in zip(taken, taken[1:])) > 5, taken
