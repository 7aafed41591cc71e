"""The hang allowance (lazarus.agent.hang): it measures the training, not waits outside it.
Steps stretched while a wait the progress does not show lasts (a daemon failover: a soak's
SIGSTOPped rank was named after 33.7 s, allowance 30 s, against 13.5 s before) and steps that
waited for a peer's checkpoint do not stretch it; a slowdown of every step does; and the
verdict says what the allowance was and what it came from."""

from __future__ import annotations

import pytest

from lazarus.agent.hang import Allowance, HangConfig, HangDetector, typical_step
from lazarus.core.contract import Progress

RANKS = (0, 1, 2, 3)


@pytest.mark.parametrize("times, quantile, want", [
    ([1.0], 0.25, 1.0),
    ([1.0, 9.0], 0.25, 1.0),
    ([0.2] * 20 + [10.0] * 40, 0.25, 0.2),      # 2/3 stretched: still the training's
    ([0.2] * 10 + [10.0] * 50, 0.25, 10.0),     # 5/6: that is how long steps take now
    ([3.0, 1.0, 2.0, 4.0, 5.0], 0.5, 3.0),
    ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),           # a sample, not the mean of two
])
def test_the_typical_step_is_a_low_quantile_of_the_samples(times, quantile, want):
    assert typical_step(times, quantile) == want


class Lockstep:
    """Ranks stepping together: data -> forward -> collective -> optimizer, each step of
    `step_s`; `ckpt` ranks go through a checkpoint of `ckpt_s` at the end of a step while the
    others wait for them in a collective."""

    def __init__(self, det: HangDetector, ranks=RANKS):
        self.det, self.ranks, self.t, self.step, self.seq = det, ranks, 100.0, 0, 0

    def _all(self, phase: str, t: float, ranks=None) -> None:
        for r in ranks if ranks is not None else self.ranks:
            self.det.observe(r, Progress(step=self.step, phase=phase, seq=self.seq, since=t))

    def steps(self, n: int, step_s: float, *, ckpt=(), ckpt_s: float = 0.0) -> None:
        for _ in range(n):
            self.step += 1
            t = self.t
            for phase, share in (("data", 0.1), ("forward", 0.6), ("collective", 0.1),
                                 ("optimizer", 0.2)):
                self._all(phase, t)
                t += share * step_s
                self.seq += 1
                assert self.det.check(t) is None
            if ckpt:
                self._all("checkpoint", t, ckpt)
                self._all("collective", t, [r for r in self.ranks if r not in ckpt])
                t += ckpt_s
                assert self.det.check(t) is None
            self.t = t

    def freeze(self, rank: int) -> float:
        """`rank` stops in its next step's forward; the others wait in its all-reduce."""
        self.step += 1
        self._all("data", self.t)
        self.det.observe(rank, Progress(step=self.step, phase="forward", seq=self.seq,
                                        since=self.t + 0.01))
        self._all("collective", self.t + 0.02, [r for r in self.ranks if r != rank])
        return self.t + 0.01


def test_a_run_of_stretched_steps_cannot_triple_the_allowance():
    # A young round: 8 steps of 0.2 s, then 12 that each waited 10 s on something outside the
    # training (nothing in their progress says so). A median of them was 10 s: 30 s.
    det = HangDetector(HangConfig(k=3, floor_s=10))
    run = Lockstep(det)
    run.steps(9, step_s=0.2)                 # the first is the warm-up
    run.steps(12, step_s=10.0)
    assert det.timeout_s() == pytest.approx(10.0)
    stopped = run.freeze(2)
    assert det.check(stopped + 9.9) is None
    verdict = det.check(stopped + 10.1)
    assert verdict is not None and verdict.culprits == (2,)
    assert verdict.timeout_s == pytest.approx(10.0)


def test_a_slowdown_of_every_step_raises_it():
    det = HangDetector(HangConfig(k=3, floor_s=10))
    run = Lockstep(det)
    run.steps(65, step_s=2.0)
    assert det.timeout_s() == pytest.approx(10.0)   # 3 x 2 s: the floor
    run.steps(64, step_s=5.0)                        # a throttled device, say
    assert det.typical_step_s == pytest.approx(5.0)
    assert det.timeout_s() == pytest.approx(15.0)
    stopped = run.freeze(1)
    assert det.check(stopped + 14.5) is None
    assert det.check(stopped + 15.5).culprits == (1,)


def test_steps_that_waited_for_a_local_peers_checkpoint_are_not_training_steps():
    # Rank 0 alone writes a checkpoint (a script of the user's own), 2 steps in 3, each one
    # 12 s behind a commit that waits on the daemon; ranks 1-3 wait for it in a collective.
    # Their steps measure the save: with them, a median of 12 s (an allowance of 36 s).
    det = HangDetector(HangConfig(k=3, floor_s=1, quantile=0.5))
    run = Lockstep(det)
    run.steps(2, step_s=1.0)
    for _ in range(8):
        run.steps(1, step_s=1.0)
        run.steps(2, step_s=1.0, ckpt=(0,), ckpt_s=12.0)
    run.steps(1, step_s=1.0)
    assert det.typical_step_s == pytest.approx(1.0)
    assert det.timeout_s() == pytest.approx(3.0)


def test_the_verdict_says_the_allowance_and_what_it_came_from():
    det = HangDetector(HangConfig(k=3, floor_s=10))
    run = Lockstep(det)
    run.steps(21, step_s=0.2)                # 4 ranks x 19 timed: the window holds 64
    verdict = det.check(run.freeze(3) + 10.5)
    assert verdict.reason.startswith(
        "no progress for 10.5 s (allowance 10.0 s = the 10 s floor (3 x 0.20 s, the lower "
        "quartile of the last 64 training steps, is less)): rank 3 stuck in forward")
    # the part before the ranks' positions (lazarus.agent.hangreport keeps it) holds it all
    assert verdict.reason.partition(": ")[0].endswith("is less))")

    det = HangDetector(HangConfig(k=3, floor_s=1))
    run = Lockstep(det)
    run.steps(11, step_s=2.0)
    got = det.group_allowance()
    assert got.seconds == pytest.approx(6.0)
    assert got.why == "3 x 2.00 s, the lower quartile of the last 36 training steps"  # 4 x 9

    det = HangDetector(HangConfig(k=3, floor_s=1, first_step_timeout_s=300))
    Lockstep(det, ranks=(0,)).steps(3, step_s=1.0)  # the warm-up, one timed, one under way
    assert det.group_allowance() == Allowance(
        300.0, "the first-step allowance, 1 of 2 training steps timed in this round")


def test_a_peer_in_a_checkpoint_lends_its_allowance_and_says_so():
    det = HangDetector(HangConfig(k=3, floor_s=1, long_k=4, long_floor_s=5, long_cap_s=600))
    run = Lockstep(det)
    run.steps(5, step_s=1.0)
    run.steps(2, step_s=1.0, ckpt=RANKS, ckpt_s=2.0)
    run.steps(1, step_s=1.0)
    run.step += 1
    run._all("checkpoint", run.t, (0,))
    run._all("collective", run.t, (1, 2, 3))
    got = det.group_allowance()
    assert got.seconds == pytest.approx(8.0)
    assert got.why == ("a peer's checkpoint, 4 x 2.00 s, the median checkpoint of 8 seen, "
                       "within [5, 600] s")
