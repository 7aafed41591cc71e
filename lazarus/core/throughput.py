"""Throughput per rank and node from the step reports, stragglers, and whether a swap pays.

In synchronous training every rank finishes a step at about the same moment (collectives
wait for the slowest), so the wall step time barely tells a slow rank from its peers. A rank's
own work is what differs: reports carry `compute_s` (lazarus.trainer.steptime), and the
straggler test uses it when present. Without it the test falls back to the wall step time,
which only separates ranks that do not wait for each other every step.

Each agent tracks its own ranks and publishes `summary()` in its node status; the daemon
rebuilds one tracker from every member's summary (lazarus.daemon.stragglers), so a rank is
judged against its peers on all nodes, step by step.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass

from lazarus.core.policy import WINDOW


@dataclass(kw_only=True, slots=True)
class ThroughputConfig:
    window: int = WINDOW     # M: the last steps judged
    margin: float = 1.2      # slower than the median of its peers by this factor ...
    min_slow: int = 8        # ... in at least N of the last M steps: a straggler


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
class Straggler:
    rank: int
    node: str
    ratio: float             # median of (own time / peers' median) over the slow steps
    slow_steps: int
    of_steps: int
    gain_s_per_step: float   # step time saved if the rank ran at its peers' pace

    @property
    def reason(self) -> str:
        return (f"rank {self.rank}{f' on {self.node}' if self.node else ''} is "
                f"{self.ratio:.2f}x slower than its peers in {self.slow_steps} of the last "
                f"{self.of_steps} steps")


@dataclass(frozen=True, slots=True)
class _Step:
    step_time_s: float
    tokens: int
    work_s: float            # compute_s when reported, else step_time_s


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class ThroughputTracker:
    def __init__(self, config: ThroughputConfig | None = None):
        self.config = config or ThroughputConfig()
        self._ranks: dict[int, deque[tuple[int, _Step]]] = {}
        self._node: dict[int, str] = {}
        self._steps: OrderedDict[int, dict[int, float]] = OrderedDict()  # step -> rank -> work

    def reset(self) -> None:
        self._ranks.clear()
        self._node.clear()
        self._steps.clear()

    def observe(self, *, rank: int, step: int, step_time_s: float, tokens: int,
                node: str = "", compute_s: float | None = None) -> None:
        if step_time_s <= 0:
            return  # a report without timing (the first step of a local session)
        rec = _Step(step_time_s=step_time_s, tokens=tokens,
                    work_s=compute_s if compute_s is not None else step_time_s)
        self._ranks.setdefault(rank, deque(maxlen=self.config.window)).append((step, rec))
        self._node[rank] = node
        self._steps.setdefault(step, {})[rank] = rec.work_s
        self._steps.move_to_end(step)
        while len(self._steps) > self.config.window:
            self._steps.popitem(last=False)

    def rank_stats(self, rank: int) -> RankStats:
        recs = [rec for _, rec in self._ranks[rank]]
        times = sorted(r.step_time_s for r in recs)
        return RankStats(rank=rank, node=self._node[rank], steps=len(recs),
                         tokens_per_s=sum(r.tokens for r in recs) / sum(times),
                         p50_s=statistics.median(times), p90_s=_quantile(times, 0.9),
                         max_s=times[-1])

    def node_stats(self) -> dict[str, NodeStats]:
        by_node: dict[str, list[int]] = {}
        for rank, node in sorted(self._node.items()):
            by_node.setdefault(node, []).append(rank)
        out = {}
        for node, ranks in by_node.items():
            stats = [self.rank_stats(r) for r in ranks]
            times = [rec.step_time_s for r in ranks for _, rec in self._ranks[r]]
            out[node] = NodeStats(node=node, ranks=tuple(ranks),
                                  tokens_per_s=sum(s.tokens_per_s for s in stats),
                                  p50_s=statistics.median(times))
        return out

    def summary(self) -> dict:
        """What a node status carries: per rank its last steps as [step, step_time_s,
        compute_s] and its throughput; the node's tokens/s and median step time."""
        ranks = {}
        for rank in sorted(self._ranks):
            st = self.rank_stats(rank)
            ranks[str(rank)] = {
                "steps": [[step, round(rec.step_time_s, 6), round(rec.work_s, 6)]
                          for step, rec in self._ranks[rank]],
                "tokens_per_s": round(st.tokens_per_s, 1), "p50_s": round(st.p50_s, 6),
                "p90_s": round(st.p90_s, 6)}
        nodes = list(self.node_stats().values())
        return {"ranks": ranks,
                "tokens_per_s": round(sum(n.tokens_per_s for n in nodes), 1),
                "p50_s": round(statistics.median([n.p50_s for n in nodes]), 6) if nodes else 0.0}

    def stragglers(self) -> list[Straggler]:
        c = self.config
        out = []
        for rank in sorted(self._ranks):
            ratios, judged = [], 0
            for by_rank in self._steps.values():
                if rank not in by_rank or len(by_rank) < 2:
                    continue
                judged += 1
                peers = statistics.median(w for r, w in by_rank.items() if r != rank)
                if peers > 0 and by_rank[rank] > c.margin * peers:
                    ratios.append(by_rank[rank] / peers)
            if len(ratios) >= c.min_slow:
                ratio = statistics.median(ratios)
                step_s = self.rank_stats(rank).p50_s
                out.append(Straggler(rank=rank, node=self._node[rank], ratio=ratio,
                                     slow_steps=len(ratios), of_steps=judged,
                                     gain_s_per_step=step_s * (1 - 1 / ratio)))
        return out
