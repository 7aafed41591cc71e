"""Straggler judgement at cluster scale (on demand): `pytest tests/bench/bench_stragglers.py -m
bench -s`.

One pass of the daemon's straggler judgement (lazarus.daemon.stragglers.find: read every
member's throughput summary, judge all ranks) at 256, 1,024 and 4,096 nodes x 8 ranks, each
rank with a full window of 20 steps and one node slow, against the step-by-step judgement it
replaced (each rank against the median of its peers in every step: quadratic in ranks). The
old one runs only where it takes seconds (up to 1,024 ranks in all); issue 11 measured it at
0.16 s for 256 ranks and 1.66 s for 1,024, and extrapolated ~25 s for 4,096.

Two figures for the new one: a view parsed anew for the pass (every node's summary read), and
a view kept up to date in place where one node wrote since the last pass (only its summary is
read again; lazarus.daemon.stragglers.find keeps the others).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import OrderedDict

import pytest

from lazarus.core.records import RUNNING
from lazarus.core.throughput import ThroughputTracker
from lazarus.daemon.stragglers import find
from tests.unit.test_decide import job, ns, status, view

pytestmark = pytest.mark.bench

RANKS_PER_NODE = 8
STEPS = 20
SLOW = 1.5          # the slow node's ranks work this many times as long


def _work(rank: int, step: int, slow: bool) -> float:
    return (SLOW if slow else 1.0) * (0.1 + 0.001 * ((rank * 7 + step * 13) % 11))


def cluster(nodes: int):
    names = [f"n{i:05d}" for i in range(nodes)]
    statuses = []
    for i, name in enumerate(names):
        tr = ThroughputTracker()
        for step in range(1, STEPS + 1):
            for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE):
                tr.observe(rank=r, step=step, step_time_s=0.2, tokens=100, node=name,
                           compute_s=_work(r, step, slow=i == 1))
        statuses.append(ns(name, "running", step=STEPS, throughput=tr.summary()))
    st = status(RUNNING, members=names)
    return st, statuses, names


def old_judgement(nodes: int, margin: float = 1.2, min_slow: int = 8) -> list[int]:
    """The replaced judgement, as it was: step -> rank -> work, then each rank against the
    median of the others in every step."""
    steps: OrderedDict[int, dict[int, float]] = OrderedDict()
    for i in range(nodes):
        for step in range(1, STEPS + 1):
            for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE):
                steps.setdefault(step, {})[r] = _work(r, step, slow=i == 1)
    out = []
    for rank in range(nodes * RANKS_PER_NODE):
        slow = 0
        for by_rank in steps.values():
            peers = statistics.median(w for r, w in by_rank.items() if r != rank)
            slow += by_rank[rank] > margin * peers
        if slow >= min_slow:
            out.append(rank)
    return out


def _timed(fn, reps: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def test_straggler_judgement_per_pass():
    rows = []
    slow_ranks = list(range(RANKS_PER_NODE, 2 * RANKS_PER_NODE))
    for nodes in (32, 128, 256, 1024, 4096):
        st, statuses, names = cluster(nodes)
        j = job()    # its policy is all the judgement reads of it

        def fresh():
            # a view parsed anew each pass: every node's summary is read
            return find(view(status=st, nodes=names, node_status=statuses, j=j), j, st)
        t_fresh, found = _timed(fresh, 3)
        assert sorted(s.rank for s in found) == slow_ranks
        kept = view(status=st, nodes=names, node_status=statuses, j=j)
        find(kept, j, st)

        def one_node_wrote():
            # a view kept up to date from a watch: one node's status is new since the last pass
            kept.node_status[names[-1]] = dataclasses.replace(kept.node_status[names[-1]])
            kept.revision += 1
            return find(kept, j, st)
        t_kept, found = _timed(one_node_wrote, 3)
        assert sorted(s.rank for s in found) == slow_ranks
        t_old = None
        if nodes * RANKS_PER_NODE <= 1024:
            t_old, old = _timed(lambda: old_judgement(nodes), 1)
            assert old == slow_ranks
        rows.append((nodes, nodes * RANKS_PER_NODE, t_fresh, t_kept, t_old))
    print(f"\n{'nodes':>6} {'ranks':>7} {'fresh view':>11} {'kept view':>10} {'old':>10}  "
          "(seconds per pass)")
    for nodes, ranks, t_fresh, t_kept, t_old in rows:
        print(f"{nodes:>6} {ranks:>7} {t_fresh:>11.4f} {t_kept:>10.4f} "
              f"{f'{t_old:.3f}' if t_old is not None else '(not run)':>10}")
