"""Hang detection from the progress each rank publishes, and naming the rank that hangs.

Every rank tells its agent where it is whenever that changes (a `Progress` record on the
worker channel): the step, the phase, how many collectives it has issued, and when it entered
the phase. Nothing is measured inside the worker beyond that: a hung rank cannot report its
own hang, but its last record says where it stopped.

A rank hangs when it has made no progress for max(k x its typical step time, floor). The
typical step is the lower quartile of the round's last training steps: steps that went
through a checkpoint or an eval, or overlapped one of a local peer's (they waited for it in a
collective), are not training steps, and a run of steps stretched by a wait the progress does
not show (an agent or a daemon away, a save's writer on the same cores) moves a low quantile
only once it fills 3/4 of the window -- a slowdown of every step does. Three cases must not
fire, and each gets its own, longer allowance:
  - the first steps of a round (none timed yet; compile and warm-up make them slow),
  - a checkpoint phase, and an eval phase (long by design, once in a while): k x the median
    duration of that phase so far, within [long_floor_s, long_cap_s] -- the cap before the
    first one is seen. Durations are kept across rounds: a save costs what it cost before,
  - peers of a rank in such a phase: they wait in a collective for it.

Every allowance says what it came from (`Allowance.why`), and a verdict's reason says it:
"allowance 10.0 s = the 10 s floor (3 x 0.21 s, the lower quartile of the last 64 training
steps, is less)".

The culprit is the rank furthest behind in the program: ordered by (step, collectives issued,
phase in step order), the ranks at the minimum are the ones the others wait for. All ranks
at the same position name none here: the culprit is on another node, and the daemon's
`combine` over every agent's report finds it.
"""

from __future__ import annotations

import dataclasses

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from lazarus.core.contract import LONG_PHASES, HangVerdict, Position, Progress
from lazarus.core.culprits import name_culprits


LONG_FLOOR_S = 30.0
LONG_CAP_S = 600.0


@dataclass(kw_only=True, slots=True)
class HangConfig:
    """`k` x the typical step time, at least `floor_s`, is the allowance of a normal step.
    Too small a floor fires on a step that is merely jittery; the typical step adapts to the
    model. A script whose steps alternate between fast ones and ones over k x slower (work
    it does not report as a checkpoint or eval phase) needs a larger k or floor."""
    k: float = 3.0
    floor_s: float = 10.0
    # Before `min_samples` step times are known (the first steps of every round).
    first_step_timeout_s: float = 300.0
    # A checkpoint or eval phase: k x its median duration, never under the floor (a save's
    # time varies with the storage's load) nor over the cap; the cap until one was seen.
    long_k: float = 4.0
    long_floor_s: float = LONG_FLOOR_S
    long_cap_s: float = LONG_CAP_S
    # Completed steps per rank left out of the window: the first one compiles and warms up.
    warmup_steps: int = 1
    min_samples: int = 2
    window: int = 64                 # the round's last training steps the quantile is of
    # The typical step: this quantile of the window. Low, so that steps stretched by a wait
    # outside the training move it only once they are 3/4 of the window.
    quantile: float = 0.25


class Allowance(NamedTuple):
    seconds: float
    # What it came from, in words. Without ": " -- a verdict's reason ends at its first one
    # and goes on with the ranks' positions (lazarus.agent.hangreport rewrites that part).
    why: str


def typical_step(times: list[float], quantile: float) -> float:
    """The `quantile` of `times` (not empty), by the nearest rank below: a sample, never an
    interpolation towards an outlier above it."""
    ordered = sorted(times)
    return ordered[math.floor((len(ordered) - 1) * quantile)]


def _quantile_name(q: float) -> str:
    return {0.25: "the lower quartile", 0.5: "the median"}.get(q, f"the {q:.0%} quantile")


@dataclass(slots=True)
class _Rank:
    progress: Progress
    step_start: float                # since of the first record seen for this step
    completed: int = 0               # steps completed under observation
    long_phase: bool = False         # this step went through a checkpoint or an eval


class HangDetector:
    """Fed with every rank's progress (`observe`), asked periodically (`check`).

    `check` returns a verdict for as long as the hang lasts; the caller acts once (capture
    stacks, report), withdraws the report if `check` clears (the ranks moved again: they were
    waiting for a peer on another node that was checkpointing), and calls `reset()` when the
    round is replaced. Times are
    time.monotonic(), the clock of the records' `since`.
    """

    def __init__(self, config: HangConfig | None = None):
        self.config = config or HangConfig()
        self._ranks: dict[int, _Rank] = {}
        self._step_times: deque[float] = deque(maxlen=self.config.window)
        # phase -> durations of its completed passes (one per rank and pass)
        self._long_times: dict[str, deque[float]] = {
            p: deque(maxlen=self.config.window) for p in LONG_PHASES}
        # (entered, left) of the long phases of this round's ranks that a step still being
        # timed may overlap
        self._long_spans: list[tuple[float, float]] = []

    def reset(self) -> None:
        """A new round: its ranks and step times start afresh; a checkpoint or eval costs
        what it did."""
        self._ranks.clear()
        self._step_times.clear()
        self._long_spans.clear()

    def rearm(self, now: float) -> None:
        """Time every rank's stall from `now` (time.monotonic()), keeping what it measured: a
        replica carried into a new round (docs/replicas.md) waited for the replica that round
        restarts, and a wait that lasts is a new hang after a whole allowance."""
        for st in self._ranks.values():
            st.progress = dataclasses.replace(st.progress, since=max(st.progress.since, now))

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def observe(self, rank: int, progress: Progress) -> None:
        """Record a rank's latest progress (its `since` is the time it got there)."""
        st = self._ranks.get(rank)
        if st is None:
            self._ranks[rank] = _Rank(progress=progress, step_start=progress.since,
                                      long_phase=progress.phase in LONG_PHASES)
            return
        left = st.progress.phase
        if left in LONG_PHASES and (progress.phase != left or progress.step != st.progress.step):
            self._long_times[left].append(progress.since - st.progress.since)
            self._long_spans.append((st.progress.since, progress.since))
        if progress.step != st.progress.step:
            if progress.step == st.progress.step + 1:
                st.completed += 1
                if (st.completed > self.config.warmup_steps and not st.long_phase
                        and not self._overlaps_long_phase(rank, st.step_start, progress.since)):
                    self._step_times.append(progress.since - st.step_start)
            st.step_start = progress.since
            st.long_phase = False
            self._forget_old_spans()
        st.long_phase |= progress.phase in LONG_PHASES
        st.progress = progress

    def _overlaps_long_phase(self, rank: int, start: float, end: float) -> bool:
        """Whether another local rank was in a checkpoint or eval during [start, end]: a
        step that waited for it in a collective measures the save, not the training."""
        return (any(entered < end and left > start for entered, left in self._long_spans)
                or any(r != rank and st.progress.phase in LONG_PHASES
                       and st.progress.since < end for r, st in self._ranks.items()))

    def _forget_old_spans(self) -> None:
        # Only steps still being timed can overlap a span: none began before the oldest start.
        oldest = min(st.step_start for st in self._ranks.values())
        self._long_spans = [(a, b) for a, b in self._long_spans if b > oldest]

    def latest(self) -> list[Progress]:
        """Each watched rank's latest progress report (the node status's level-0 counts)."""
        return [st.progress for st in self._ranks.values()]

    def long_phase_since(self) -> float | None:
        """When the earliest rank now in a checkpoint or an eval entered it; None if none is.
        Published by the agent: ranks on other nodes wait for such a rank in a collective,
        and only this agent knows why (lazarus.daemon.decide waits with their reports)."""
        return min((st.progress.since for st in self._ranks.values()
                    if st.progress.phase in LONG_PHASES), default=None)

    @property
    def typical_step_s(self) -> float | None:
        """The step time the allowance multiplies (None before `min_samples` are timed)."""
        if len(self._step_times) < self.config.min_samples:
            return None
        return typical_step(list(self._step_times), self.config.quantile)

    def long_allowance(self, phase: str) -> float:
        """How long a rank may stay in a checkpoint or eval phase now."""
        return self._long(phase).seconds

    def _long(self, phase: str) -> Allowance:
        c = self.config
        times = self._long_times.get(phase)
        if not times:
            return Allowance(c.long_cap_s, f"the {c.long_cap_s:g} s cap of a {phase}, none seen "
                                           "yet")
        median = statistics.median(times)
        seconds = min(c.long_cap_s, max(c.long_floor_s, c.long_k * median))
        return Allowance(seconds, f"{c.long_k:g} x {median:.2f} s, the median {phase} of "
                                  f"{len(times)} seen, within [{c.long_floor_s:g}, "
                                  f"{c.long_cap_s:g}] s")

    def _step(self) -> Allowance:
        c = self.config
        typical = self.typical_step_s
        if typical is None:
            return Allowance(c.first_step_timeout_s,
                             f"the first-step allowance, {len(self._step_times)} of "
                             f"{c.min_samples} training steps timed in this round")
        measured = (f"{c.k:g} x {typical:.2f} s, {_quantile_name(c.quantile)} of the last "
                    f"{len(self._step_times)} training steps")
        if c.k * typical >= c.floor_s:
            return Allowance(c.k * typical, measured)
        return Allowance(c.floor_s, f"the {c.floor_s:g} s floor ({measured}, is less)")

    def allowance(self, phase: str) -> Allowance:
        """How long a rank in `phase` may go without progress now, and why."""
        return self._long(phase) if phase in LONG_PHASES else self._step()

    def group_allowance(self) -> Allowance:
        """The allowance a rank gets now, counting peers in a long phase: they wait for it."""
        long = sorted({st.progress.phase for st in self._ranks.values()} & set(LONG_PHASES))
        best = self._step()
        for phase in long:
            a = self._long(phase)
            if a.seconds > best.seconds:
                best = Allowance(a.seconds, f"a peer's {phase}, {a.why}")
        return best

    def timeout_s(self) -> float:
        """The allowance a rank gets now, counting peers in a long phase."""
        return self.group_allowance().seconds

    def check(self, now: float) -> HangVerdict | None:
        if not self._ranks:
            return None
        positions = {rank: Position(step=st.progress.step, phase=st.progress.phase,
                                    seq=st.progress.seq, stalled_s=now - st.progress.since,
                                    op=st.progress.op)
                     for rank, st in self._ranks.items()}
        # Peers wait for a rank in a long phase: they share its allowance. A rank in the
        # long phase itself gets no more than that phase's allowance.
        group = self.group_allowance()
        expired = []
        for rank, pos in positions.items():
            limit = self.allowance(pos.phase) if pos.phase in LONG_PHASES else group
            if pos.stalled_s > limit.seconds:
                expired.append((pos.stalled_s, limit))
        if not expired:
            return None
        stalled_s, timeout = max(expired, key=lambda e: (e[0], e[1].seconds))
        culprits, reason = name_culprits(positions)
        return HangVerdict(culprits=culprits, reason=f"no progress for {stalled_s:.1f} s "
                           f"(allowance {timeout.seconds:.1f} s = {timeout.why}): {reason}",
                           stalled_s=stalled_s, timeout_s=timeout.seconds, positions=positions)
