"""Hang detection over progress records: when it fires, when it must stay quiet (first step,
checkpoint, eval), and which rank and node it names."""

import json

import pytest

from lazarus.agent.hang import HangConfig, HangDetector
from lazarus.core.contract import HangVerdict, Position, Progress
from lazarus.core.culprits import ClusterHang, combine, name_culprits

RANKS = (0, 1, 2, 3)


class Run:
    """Ranks stepping in lockstep: data -> forward -> backward -> all_reduce -> optimizer.
    Each step issues 10 collectives (FSDP's inside forward/backward, plus the all_reduce)."""

    def __init__(self, detector, ranks=RANKS):
        self.det, self.ranks = detector, ranks
        self.t, self.step, self.seq = 100.0, 0, 0
        self.quiet = True       # did check() stay silent all along?

    def at(self, rank, phase, since, *, seq=None, step=None, op=""):
        self.det.observe(rank, Progress(step=self.step if step is None else step, phase=phase,
                                        seq=self.seq if seq is None else seq, since=since, op=op))

    def check(self, now):
        verdict = self.det.check(now)
        self.quiet &= verdict is None
        return verdict

    def steps(self, n, step_s=1.0, extra=None):
        """n steps of step_s each; `extra` = (phase, seconds) appended to every step."""
        for _ in range(n):
            self.step += 1
            t = self.t
            for phase, share, issued in (("data", 0.1, 0), ("forward", 0.3, 4),
                                         ("backward", 0.3, 5), ("collective", 0.1, 1),
                                         ("optimizer", 0.2, 0)):
                for r in self.ranks:
                    self.at(r, phase, t, op="all_reduce" if phase == "collective" else "")
                t += share * step_s
                self.check(t)
                self.seq += issued
            if extra:
                phase, seconds = extra
                for r in self.ranks:
                    self.at(r, phase, t)
                t += seconds
                self.check(t)
            self.t = t

    def stall(self, culprit, phase="data"):
        """Next step: `culprit` stops in `phase`; the others reach the step's all_reduce.
        Returns the time the culprit stopped."""
        self.step += 1
        for r in self.ranks:
            self.at(r, "data", self.t)
        self.at(culprit, phase, self.t + 0.1)
        for r in self.ranks:
            if r != culprit:
                self.at(r, "collective", self.t + 0.7, seq=self.seq + 9, op="all_reduce")
        return self.t + 0.1


def test_steady_training_is_quiet_and_sets_the_median():
    det = HangDetector(HangConfig(k=3, floor_s=2))
    run = Run(det)
    run.steps(20, step_s=1.0)
    assert run.quiet
    assert det.typical_step_s == pytest.approx(1.0)
    assert det.timeout_s() == pytest.approx(3.0)


def test_rank_stuck_outside_the_collective_is_named_after_k_median_steps():
    det = HangDetector(HangConfig(k=3, floor_s=2))
    run = Run(det)
    run.steps(10, step_s=1.0)
    stopped = run.stall(culprit=2, phase="data")
    assert run.check(stopped + 2.9) is None
    verdict = run.check(stopped + 3.1)
    assert verdict is not None
    assert verdict.culprits == (2,)
    assert verdict.timeout_s == pytest.approx(3.0)
    assert "rank 2 stuck in data at step 11" in verdict.reason
    assert "ranks 0,1,3 wait in all_reduce at step 11" in verdict.reason


def test_floor_holds_when_steps_are_fast():
    det = HangDetector(HangConfig(k=3, floor_s=5))
    run = Run(det)
    run.steps(10, step_s=0.1)
    since = run.stall(culprit=0)
    assert run.check(since + 4.5) is None
    assert run.check(since + 5.5).culprits == (0,)


def test_rank_lagging_in_collective_count_is_the_culprit():
    det = HangDetector(HangConfig(k=3, floor_s=1))
    run = Run(det)
    run.steps(5)
    # Everyone is in a collective, but rank 1 waits in an earlier one (it skipped ahead less).
    for r in RANKS:
        run.at(r, "collective", run.t, seq=run.seq + (3 if r == 1 else 9), step=6,
               op="all_gather")
    verdict = run.check(run.t + 3.5)
    assert verdict.culprits == (1,)
    assert "rank 1 stuck in all_gather at step 6 after 53 collectives" in verdict.reason


def test_all_ranks_level_names_no_local_culprit():
    det = HangDetector(HangConfig(k=3, floor_s=1))
    run = Run(det)
    run.steps(5)
    for r in RANKS:
        run.at(r, "collective", run.t, step=6, op="all_reduce")
    verdict = run.check(run.t + 3.5)
    assert verdict.culprits == ()
    assert "not among them" in verdict.reason


def test_slow_first_step_is_not_a_hang():
    det = HangDetector(HangConfig(k=3, floor_s=1, first_step_timeout_s=300))
    run = Run(det)
    for r in RANKS:
        run.at(r, "forward", 100.0, step=1)
    assert run.check(100.0 + 120) is None      # compiling, say
    run.steps(1, step_s=1.0)
    assert run.quiet                           # still no median: one step is not enough
    verdict = run.check(100.0 + 301)
    assert verdict is not None and verdict.timeout_s == 300


def test_warmup_step_is_left_out_of_the_median():
    det = HangDetector(HangConfig(k=3, floor_s=1, warmup_steps=1, min_samples=2))
    run = Run(det)
    run.steps(1, step_s=50.0)                  # the compile step
    run.steps(2, step_s=1.0)
    assert det.typical_step_s == pytest.approx(1.0)
    since = run.stall(culprit=3)
    assert run.check(since + 5).culprits == (3,)


def test_long_checkpoint_step_is_quiet_and_a_hang_after_it_is_still_caught_fast():
    det = HangDetector(HangConfig(k=3, floor_s=1, long_cap_s=600))
    run = Run(det)
    run.steps(5, step_s=1.0)
    # Rank 0 writes the checkpoint for 100 s while the others wait for it in a collective.
    run.step += 1
    run.at(0, "checkpoint", run.t)
    for r in (1, 2, 3):
        run.at(r, "collective", run.t, op="barrier")
    assert run.check(run.t + 100) is None
    run.t += 100
    run.steps(5, step_s=1.0)
    assert run.quiet
    assert det.typical_step_s == pytest.approx(1.0)
    since = run.stall(culprit=1)               # a real hang right after is still caught fast
    assert run.check(since + 3.5).culprits == (1,)


def test_checkpoint_that_never_ends_is_a_hang():
    det = HangDetector(HangConfig(k=3, floor_s=1, long_cap_s=60))
    run = Run(det)
    run.steps(5)
    for r in RANKS:
        run.at(r, "checkpoint", run.t)
    assert run.check(run.t + 59) is None      # the first save of all: the cap
    assert run.check(run.t + 61).timeout_s == 60


def test_checkpoint_allowance_adapts_to_the_saves_seen_and_outlives_the_round():
    det = HangDetector(HangConfig(k=3, floor_s=1, long_k=4, long_floor_s=5, long_cap_s=600))
    run = Run(det)
    run.steps(3)
    for save_s in (2.0, 2.5, 3.0):             # three saves of 2-3 s
        run.steps(1, extra=("checkpoint", save_s))
    run.steps(1)                               # the last save ends with the next step
    assert det.long_allowance("checkpoint") == pytest.approx(4 * 2.5)
    assert det.long_allowance("eval") == 600   # no eval seen yet
    det.reset()                                # a new round: a save still costs that much
    assert det.long_allowance("checkpoint") == pytest.approx(10.0)
    run = Run(det)
    run.steps(3)
    for r in RANKS:
        run.at(r, "checkpoint", run.t)
    assert run.check(run.t + 9) is None
    verdict = run.check(run.t + 11)            # a save 4x the usual: not a slow disk any more
    assert verdict is not None and verdict.timeout_s == pytest.approx(10.0)


def test_eval_is_quiet():
    det = HangDetector(HangConfig(k=3, floor_s=1, long_cap_s=600))
    run = Run(det)
    run.steps(5)
    run.steps(8, step_s=1.0, extra=("eval", 200.0))
    assert run.quiet
    assert det.typical_step_s == pytest.approx(1.0)   # eval steps are not step times


def test_reset_forgets_the_old_round():
    det = HangDetector(HangConfig(k=3, floor_s=1))
    run = Run(det)
    run.steps(5)
    det.reset()
    assert det.check(run.t + 1000) is None
    assert det.typical_step_s is None


def test_progress_message_round_trip_and_bad_phase():
    p = Progress(step=7, phase="collective", seq=42, since=12.5, op="all_reduce")
    msg = json.loads(json.dumps(p.to_message(rank=3, round=2)))
    assert msg["type"] == "progress" and msg["rank"] == 3 and msg["round"] == 2
    assert Progress.from_message(msg) == p
    with pytest.raises(ValueError, match="unknown phase 'lunch'"):
        Progress(step=1, phase="lunch", seq=0, since=0.0)


def verdict(positions):
    culprits, reason = name_culprits(positions)
    return HangVerdict(culprits=culprits, reason=reason, stalled_s=30.0, timeout_s=10.0,
                       positions=positions)


def test_verdict_survives_json():
    v = verdict({0: Position(step=3, phase="collective", seq=9, stalled_s=30.0, op="x"),
                 1: Position(step=3, phase="forward", seq=8, stalled_s=31.0)})
    assert HangVerdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v


def test_combine_names_the_node_of_the_lagging_rank():
    a = verdict({0: Position(step=9, phase="collective", seq=42, stalled_s=30, op="all_reduce"),
                 1: Position(step=9, phase="collective", seq=42, stalled_s=30, op="all_reduce")})
    b = verdict({2: Position(step=9, phase="collective", seq=42, stalled_s=30, op="all_reduce"),
                 3: Position(step=9, phase="backward", seq=37, stalled_s=31)})
    assert a.culprits == ()                    # node a alone cannot tell
    hang = combine({"node-a": a, "node-b": b})
    assert hang == ClusterHang(culprit_ranks=(3,), culprit_nodes=("node-b",),
                               reason=hang.reason)
    assert hang.reason.startswith("node node-b: rank 3 stuck in backward at step 9")


def test_combine_without_a_laggard_names_no_node():
    level = Position(step=9, phase="collective", seq=42, stalled_s=30, op="all_reduce")
    hang = combine({"a": verdict({0: level}), "b": verdict({1: level})})
    assert hang.culprit_nodes == () and hang.culprit_ranks == ()


def test_long_phase_since_names_the_earliest_rank_in_a_checkpoint():
    det = HangDetector(HangConfig(floor_s=1.0))
    det.observe(0, Progress(step=5, phase="checkpoint", seq=10, since=100.0))
    det.observe(1, Progress(step=6, phase="forward", seq=12, since=101.0))
    assert det.long_phase_since() == 100.0
    det.observe(0, Progress(step=6, phase="forward", seq=12, since=103.0))
    assert det.long_phase_since() is None
