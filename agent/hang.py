"""Hang detection from the progress each rank publishes, and naming the rank that hangs.

Every rank tells its agent where it is whenever that changes (a `Progress` record on the
worker channel): the step, the phase, how many collectives it has issued, and when it entered
the phase. Nothing is measured inside the worker beyond that: a hung rank cannot report its
own hang, but its last record says where it stopped.

A rank hangs when it has made no progress for max(k x median step time, floor). Three cases
must not fire, and each gets its own, longer allowance:
  - the first steps of a round (no median yet; compile and warm-up make them slow),
  - a checkpoint phase, and an eval phase (long by design, once in a while): k x the median
    duration of that phase so far, within [long_floor_s, long_cap_s] -- the cap before the
    first one is seen. Durations are kept across rounds: a save costs what it cost before,
  - peers of a rank in such a phase: they wait in a collective for it.

The culprit is the rank furthest behind in the program: ordered by (step, collectives issued,
phase in step order), the ranks at the minimum are the ones the others wait for. All ranks
at the same position name none here: the culprit is on another node, and the daemon's
`combine` over every agent's report finds it.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from lazarus.core.contract import LONG_PHASES, HangVerdict, Position, Progress
from lazarus.core.culprits import name_culprits


LONG_FLOOR_S = 30.0
LONG_CAP_S = 600.0


@dataclass(kw_only=True, slots=True)
class HangConfig:
    """`k` x median step time, at least `floor_s`, is the allowance of a normal step. Too
    small a floor fires on a step that is merely jittery; the median adapts to the model."""
    k: float = 3.0
    floor_s: float = 10.0
    # Before `min_samples` step times are known (the first steps of every round).
    first_step_timeout_s: float = 300.0
    # A checkpoint or eval phase: k x its median duration, never under the floor (a save's
    # time varies with the storage's load) nor over the cap; the cap until one was seen.
    long_k: float = 4.0
    long_floor_s: float = LONG_FLOOR_S
    long_cap_s: float = LONG_CAP_S
    # Completed steps per rank left out of the median: the first one compiles and warms up.
    warmup_steps: int = 1
    min_samples: int = 2
    window: int = 64                 # step times the median is taken over


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

    def reset(self) -> None:
        """A new round: its ranks and step times start afresh; a checkpoint or eval costs
        what it did."""
        self._ranks.clear()
        self._step_times.clear()

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
        if progress.step != st.progress.step:
            if progress.step == st.progress.step + 1:
                st.completed += 1
                if st.completed > self.config.warmup_steps and not st.long_phase:
                    self._step_times.append(progress.since - st.step_start)
            st.step_start = progress.since
            st.long_phase = False
        st.long_phase |= progress.phase in LONG_PHASES
        st.progress = progress

    def long_phase_since(self) -> float | None:
        """When the earliest rank now in a checkpoint or an eval entered it; None if none is.
        Published by the agent: ranks on other nodes wait for such a rank in a collective,
        and only this agent knows why (lazarus.daemon.decide waits with their reports)."""
        return min((st.progress.since for st in self._ranks.values()
                    if st.progress.phase in LONG_PHASES), default=None)

    @property
    def median_step_s(self) -> float | None:
        if len(self._step_times) < self.config.min_samples:
            return None
        return statistics.median(self._step_times)

    def long_allowance(self, phase: str) -> float:
        """How long a rank may stay in a checkpoint or eval phase now."""
        c = self.config
        times = self._long_times.get(phase)
        if not times:
            return c.long_cap_s
        return min(c.long_cap_s, max(c.long_floor_s, c.long_k * statistics.median(times)))

    def _allowance(self, phase: str) -> float:
        c = self.config
        if phase in LONG_PHASES:
            return self.long_allowance(phase)
        median = self.median_step_s
        return c.first_step_timeout_s if median is None else max(c.k * median, c.floor_s)

    def timeout_s(self) -> float:
        """The allowance a rank gets now, counting peers in a long phase."""
        long = {st.progress.phase for st in self._ranks.values()} & set(LONG_PHASES)
        return max([self._allowance("data")] + [self._allowance(p) for p in long])

    def check(self, now: float) -> HangVerdict | None:
        if not self._ranks:
            return None
        positions = {rank: Position(step=st.progress.step, phase=st.progress.phase,
                                    seq=st.progress.seq, stalled_s=now - st.progress.since,
                                    op=st.progress.op)
                     for rank, st in self._ranks.items()}
        # Peers wait for a rank in a long phase: they share its allowance. A rank in the
        # long phase itself gets no more than that phase's allowance.
        group = self.timeout_s()
        expired = []
        for rank, pos in positions.items():
            limit = self._allowance(pos.phase) if pos.phase in LONG_PHASES else group
            if pos.stalled_s > limit:
                expired.append((pos.stalled_s, limit))
        if not expired:
            return None
        stalled_s, timeout = max(expired)
        culprits, reason = name_culprits(positions)
        return HangVerdict(culprits=culprits, reason=f"no progress for {stalled_s:.1f} s "
                           f"(allowance {timeout:.1f} s): {reason}",
                           stalled_s=stalled_s, timeout_s=timeout, positions=positions)
