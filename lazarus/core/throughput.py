"""Throughput per rank and node from the step reports, and stragglers judged across ranks.

In synchronous training every rank finishes a step at about the same moment (collectives
wait for the slowest), so the wall step time barely tells a slow rank from its peers. A rank's
own work is what differs: reports carry `compute_s` (lazarus.trainer.steptime), and the
straggler test uses it when present. Without it the test falls back to the wall step time,
which only separates ranks that do not wait for each other every step.

Each agent tracks its own ranks and publishes `summary()` in its node status: per rank the
work times of its last WINDOW samples, sorted (no step numbers: nothing is compared step by
step any more), the steps and seconds they span, and its median step time. A sample is one
step, or the mean of consecutive steps pooled until they span `sample_s`: the evidence a
report rests on is at least WINDOW x sample_s seconds, however short the steps. The daemon reads every member's summary back with
`read_summary()` and `judge()`s all ranks at once: a rank's peers are the median of every
other rank's median work, one sort for the whole run (O(ranks log ranks)), and the rank is a
straggler when at least `min_slow` of its window's steps took longer than `margin` x that. A
node whose ranks are all slow is caught as well as one slow rank among fast ones, as long as
they are fewer than half of the ranks.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from lazarus.core.policy import WINDOW

# Work times are published with this many significant digits: exact enough for a margin of
# a few percent, and a third of the bytes of full floats.
DIGITS = 4


@dataclass(kw_only=True, slots=True)
class ThroughputConfig:
    window: int = WINDOW     # M: the last steps judged
    margin: float = 1.2      # slower than the median of its peers by this factor ...
    min_slow: int = 14       # ... in at least N of the last M steps: a straggler
    # Peers whose current pace is this much slower than their own best of the round were hit
    # by the same event (machine-wide contention, a checkpoint flush, another node's
    # preflight): nobody is judged against them until they are back.
    contention: float = 1.15
    # A sample of the window spans at least this much wall time: steps faster than that are
    # pooled (their mean), so a full window is at least WINDOW x sample_s of evidence. A
    # one-rank burst of 1-3 s (a flush, a page-cache storm, a daemon pass on a shared host)
    # fills 14 of 20 fifty-millisecond steps, and a report needs more than that; steps of
    # sample_s or longer are samples of their own, as before.
    sample_s: float = 0.25


# A rank is warm, and its steps count, once its pace has stopped falling: WARM_RUN steps in a
# row within WARM_SPREAD of their median, or WARM_RUN steps whose median is no faster than
# the WARM_RUN before them by more than WARM_SPREAD (a rank that is uneven but no longer
# speeding up). Its first steps after a (re)start pay for first use (DTensor, FSDP, the
# allocator, compilation; on shared CPUs, a restored peer's start), and how long that lasts
# differs by model and machine, so it is measured per rank and round, not assumed.
WARM_RUN = 5
WARM_SPREAD = 1.1


@dataclass(frozen=True, slots=True)
class RankStats:
    rank: int
    node: str
    steps: int
    tokens_per_s: float
    p50_s: float
    p90_s: float
    max_s: float


@dataclass(frozen=True, slots=True)
class NodeStats:
    node: str
    ranks: tuple[int, ...]
    tokens_per_s: float      # sum over its ranks
    p50_s: float             # median step time over its ranks' windows


@dataclass(frozen=True, slots=True)
class RankSummary:
    """What the straggler test needs of one rank: its window's work times, sorted."""
    rank: int
    node: str
    work_s: tuple[float, ...]
    p50_s: float             # median wall step time: what a step costs the run now
    base_s: float | None = None  # its best median work time of the round (None: unknown)
    warmup: int = 0          # steps of the round it took to warm up (held out of work_s)
    steps: int = 0           # steps the window's samples hold (0: one step per sample)
    span_s: float = 0.0      # wall time they took (0: unknown)

    @property
    def steps_per_sample(self) -> float:
        return self.steps / len(self.work_s) if self.steps and self.work_s else 1.0


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    node: str
    ratio: float             # median of (own time / peers' median) over the slow samples
    slow_steps: int          # steps in the slow samples
    of_steps: int            # steps in the window
    gain_s_per_step: float   # step time saved if the rank ran at its peers' pace
    step_s: float = 0.0      # its median wall step time: what a step of the run takes now
    slow_samples: int = 0    # samples of the window slower than the margin (0: = slow_steps)
    of_samples: int = 0
    span_s: float = 0.0      # wall time of the window

    @property
    def reason(self) -> str:
        who = f"rank {self.rank}{f' on {self.node}' if self.node else ''}"
        if self.of_samples in (0, self.of_steps):
            return (f"{who} is {self.ratio:.2f}x slower than its peers in {self.slow_steps} "
                    f"of the last {self.of_steps} steps")
        return (f"{who} is {self.ratio:.2f}x slower than its peers in {self.slow_samples} of "
                f"its last {self.of_samples} samples ({self.of_steps} steps, "
                f"{self.span_s:.1f} s)")


@dataclass(frozen=True, slots=True)
class _Step:
    step_time_s: float       # a sample of several steps: their mean
    tokens: int              # ... their sum
    work_s: float            # compute_s when reported, else step_time_s (mean)
    steps: int = 1


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _median(sorted_values) -> float:
    n = len(sorted_values)
    return (sorted_values[(n - 1) // 2] + sorted_values[n // 2]) / 2


def _median_without(values: list[float], i: int) -> float:
    """statistics.median of sorted `values` with the element at index i left out; O(1)."""
    n = len(values) - 1
    lo, hi = (n - 1) // 2, n // 2
    return (values[lo if lo < i else lo + 1] + values[hi if hi < i else hi + 1]) / 2


def judge(ranks: Iterable[RankSummary], config: ThroughputConfig) -> list[Straggler]:
    """Stragglers among `ranks`, by rank. One sort of the ranks' medians, then a binary search
    in each rank's own window: O(R log R + R log M) for R ranks."""
    ranks = sorted((r for r in ranks if r.work_s), key=lambda r: r.rank)
    if len(ranks) < 2:
        return []
    medians = sorted(_median(r.work_s) for r in ranks)
    # Leaving one rank out moves the median by at most one place, so no rank's peers are
    # faster than the run's median without its slowest rank: a rank with fewer than min_slow
    # steps above margin x that cannot be slow, which settles nearly every rank in O(1).
    least = config.margin * _median_without(medians, len(medians) - 1)
    k = config.min_slow
    out = []
    bases = sorted(r.base_s for r in ranks if r.base_s is not None and r.base_s > 0)
    for r in ranks:
        if len(r.work_s) < k or not r.work_s[-k] > least:
            continue
        peers = _median_without(medians, bisect.bisect_left(medians, _median(r.work_s)))
        if not peers > 0:
            continue
        if _contended(peers, bases, r, config):
            continue
        slow = r.work_s[bisect.bisect_right(r.work_s, config.margin * peers):]
        # ... and slow in most of its window, not only in its heaviest steps: rank 0's
        # commits and metrics, a checkpoint's background writer or a neighbour's burst on a
        # shared host make some steps of a healthy rank slow, never most of them.
        if len(slow) >= k and _median(r.work_s) > config.margin * peers:
            ratio = _median(slow) / peers
            per = r.steps_per_sample
            out.append(Straggler(rank=r.rank, node=r.node, ratio=ratio,
                                 slow_steps=round(len(slow) * per),
                                 of_steps=r.steps or len(r.work_s),
                                 gain_s_per_step=r.p50_s * (1 - 1 / ratio),
                                 step_s=r.p50_s, slow_samples=len(slow),
                                 of_samples=len(r.work_s), span_s=r.span_s))
    return out


def _contended(peers: float, bases: list[float], r: RankSummary,
               config: ThroughputConfig) -> bool:
    """Whether the peers of `r` are themselves slowed, against their own best pace of the
    round: then whatever slowed `r` hit them too, and `r` is not judged. `bases`: every
    rank's best, sorted (ranks of agents that publish none are left out of it)."""
    if len(bases) < 2:
        return False
    own = r.base_s if r.base_s is not None and r.base_s > 0 else None
    peer_base = (_median_without(bases, bisect.bisect_left(bases, own)) if own is not None
                 else _median(bases))
    return peers > config.contention * peer_base


def read_summary(node: str, doc: object, *, window: int = WINDOW) -> list[RankSummary]:
    """The ranks of a node's published `summary()`. Garbage from one agent is no evidence
    against it: a rank whose entry is malformed is left out, a non-finite time is dropped."""
    ranks = doc.get("ranks") if isinstance(doc, dict) else None
    out = []
    for rank, entry in ranks.items() if isinstance(ranks, dict) else ():
        try:
            work, p50 = entry["work_s"], float(entry["p50_s"])
            if not isinstance(work, list) or len(work) > window:
                continue
            # One sum tells whether every time is a finite number (a NaN or an infinity
            # makes it non-finite, a string raises): the exact check only for the rare bad one.
            if not math.isfinite(math.fsum(work)):
                work = [x for x in work if math.isfinite(x)]
            base = entry.get("base_s")
            base = float(base) if base is not None else None
            warmup = entry.get("warmup", 0)
            steps, span = entry.get("steps", 0), entry.get("span_s", 0.0)
            steps = steps if _count(steps) and steps >= len(work) else 0
            span = float(span) if _count(span) or isinstance(span, float) else 0.0
            out.append(RankSummary(rank=int(rank), node=node, work_s=tuple(sorted(work)),
                                   p50_s=p50 if math.isfinite(p50) else 0.0,
                                   base_s=base if base is not None and math.isfinite(base)
                                   and base > 0 else None,
                                   warmup=warmup if _count(warmup) else 0, steps=steps,
                                   span_s=span if math.isfinite(span) and span > 0 else 0.0))
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
    return out


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class ThroughputTracker:
    """A node's ranks' recent steps, per round (`reset` at each). A rank's steps count from
    the first run of WARM_RUN steady ones (see WARM_RUN); before that they are its warm-up.
    Steps shorter than `sample_s` are pooled into samples of at least that span."""

    def __init__(self, config: ThroughputConfig | None = None):
        self.config = config or ThroughputConfig()
        self._ranks: dict[int, deque[_Step]] = {}
        self._node: dict[int, str] = {}
        self._warming: dict[int, deque[_Step]] = {}
        self._warmup: dict[int, int] = {}      # steps held out before the rank was warm
        self._base: dict[int, float] = {}      # best median work time of a half-full window
        self._pool: dict[int, list[_Step]] = {}  # steps of the sample being filled

    def reset(self) -> None:
        self._ranks.clear()
        self._node.clear()
        self._warming.clear()
        self._warmup.clear()
        self._base.clear()
        self._pool.clear()

    def observe(self, *, rank: int, step: int, step_time_s: float, tokens: int,
                node: str = "", compute_s: float | None = None) -> None:
        if step_time_s <= 0:
            return  # a report without timing (the first step of a local session)
        rec = _Step(step_time_s=step_time_s, tokens=tokens,
                    work_s=compute_s if compute_s is not None else step_time_s)
        self._node[rank] = node
        window = self._ranks.get(rank)
        if window is None:
            warming = self._warming.setdefault(rank, deque(maxlen=2 * WARM_RUN))
            warming.append(rec)
            self._warmup[rank] = self._warmup.get(rank, 0) + 1
            if not _warm(warming):
                return
            # Warm: its last WARM_RUN steps start the window; the steps before were warm-up.
            last = list(warming)[-WARM_RUN:]
            self._warmup[rank] -= len(last)
            window = self._ranks[rank] = deque(maxlen=self.config.window)
            del self._warming[rank]
            for r in last:
                self._add(rank, window, r)
        else:
            self._add(rank, window, rec)

    def _add(self, rank: int, window: deque[_Step], rec: _Step) -> None:
        pool = self._pool.setdefault(rank, [])
        pool.append(rec)
        if sum(r.step_time_s for r in pool) < self.config.sample_s:
            return
        del self._pool[rank]
        if len(pool) > 1:
            n = len(pool)
            rec = _Step(step_time_s=sum(r.step_time_s for r in pool) / n,
                        tokens=sum(r.tokens for r in pool),
                        work_s=sum(r.work_s for r in pool) / n, steps=n)
        window.append(rec)
        if len(window) >= self.config.window // 2:
            median = statistics.median(r.work_s for r in window)
            self._base[rank] = min(median, self._base.get(rank, median))

    def rank_stats(self, rank: int) -> RankStats:
        recs = self._ranks[rank]
        times = sorted(r.step_time_s for r in recs)
        return RankStats(rank=rank, node=self._node[rank], steps=sum(r.steps for r in recs),
                         tokens_per_s=(sum(r.tokens for r in recs)
                                       / sum(r.step_time_s * r.steps for r in recs)),
                         p50_s=statistics.median(times), p90_s=_quantile(times, 0.9),
                         max_s=times[-1])

    def node_stats(self) -> dict[str, NodeStats]:
        by_node: dict[str, list[int]] = {}
        for rank, node in sorted(self._node.items()):
            if self._ranks.get(rank):  # a rank still warming up has no window yet
                by_node.setdefault(node, []).append(rank)
        out = {}
        for node, ranks in by_node.items():
            stats = [self.rank_stats(r) for r in ranks]
            times = [rec.step_time_s for r in ranks for rec in self._ranks[r]]
            out[node] = NodeStats(node=node, ranks=tuple(ranks),
                                  tokens_per_s=sum(s.tokens_per_s for s in stats),
                                  p50_s=statistics.median(times))
        return out

    def rank_summaries(self) -> list[RankSummary]:
        return [RankSummary(rank=rank, node=self._node[rank],
                            work_s=tuple(sorted(_short(r.work_s) for r in recs)),
                            p50_s=statistics.median(r.step_time_s for r in recs),
                            base_s=_short(self._base[rank]) if rank in self._base else None,
                            warmup=self._warmup.get(rank, 0),
                            steps=sum(r.steps for r in recs),
                            span_s=_short(sum(r.step_time_s * r.steps for r in recs)))
                for rank, recs in sorted(self._ranks.items()) if recs]

    def summary(self) -> dict:
        """What a node status carries: per rank its window's work times (sorted) and median
        step time, which is all the daemon judges with (read_summary); the node's tokens/s
        and median step time. It is most of a node status's bytes, and etcd keeps each
        rewrite until a compaction."""
        ranks = {str(s.rank): {"work_s": list(s.work_s), "p50_s": _short(s.p50_s),
                               "warmup": s.warmup, "steps": s.steps, "span_s": s.span_s,
                               **({"base_s": s.base_s} if s.base_s is not None else {})}
                 for s in self.rank_summaries()}
        nodes = list(self.node_stats().values())
        return {"ranks": ranks,
                "tokens_per_s": round(sum(n.tokens_per_s for n in nodes), 1),
                "p50_s": _short(statistics.median([n.p50_s for n in nodes])) if nodes else 0.0}

    def stragglers(self) -> list[Straggler]:
        return judge(self.rank_summaries(), self.config)


def _warm(steps: deque[_Step]) -> bool:
    """Whether a rank's pace has stopped falling, from its last 2 x WARM_RUN steps (WARM_RUN)."""
    if len(steps) < WARM_RUN:
        return False
    times = [r.work_s for r in steps]
    last = sorted(times[-WARM_RUN:])
    median = _median(last)
    if median > 0 and last[-1] <= WARM_SPREAD * median and last[0] * WARM_SPREAD >= median:
        return True
    if len(times) < 2 * WARM_RUN:
        return False
    return median * WARM_SPREAD >= _median(sorted(times[:WARM_RUN]))


def _short(x: float) -> float:
    return float(f"{x:.{DIGITS}g}")
