"""The daemon's straggler policy across nodes (table tests of decide()) and its config."""

from __future__ import annotations

import dataclasses

import pytest

from lazarus.core import jobspec
from lazarus.core.throughput import ThroughputConfig, ThroughputTracker
from lazarus.daemon.actions import Emit, RequestDrain, SetStatus
from lazarus.daemon.decide import decide
from lazarus.daemon.stragglers import swap_pays
from lazarus.core.errors import UserError
from lazarus.core.records import RUNNING
from tests.unit.test_decide import NOW, job, ns, only, status, view


def summary(node_ranks: dict[int, float], *, steps=20, step_s=1.0) -> dict:
    """A node's throughput summary: each rank computes `compute_s` every step."""
    tr = ThroughputTracker()
    for step in range(1, steps + 1):
        for rank, compute_s in node_ranks.items():
            tr.observe(rank=rank, step=step, step_time_s=step_s, tokens=100,
                       compute_s=compute_s)
    return tr.summary()


def with_policy(steps=1000, **policy):
    j = job()
    return jobspec.from_dict({"job": {"name": "t", "nodes": 2, "min_nodes": 1,
                                      "nproc_per_node": 2, "id": "J"},
                              "train": {**j.train, "steps": steps}, "policy": policy},
                             source="test")


def running(b_compute, *, a_compute=0.5, step=100, **st):
    return (status(RUNNING, **st),
            [ns("a", "running", step=step, throughput=summary({0: a_compute, 1: a_compute})),
             ns("b", "running", step=step, throughput=summary({2: b_compute, 3: b_compute}))])


def test_a_persistently_slow_node_is_swapped_once_its_slowness_has_lasted_and_pays():
    # 2x slower: found in its first window (20 steps of 1 s: as long as 2 swaps cost, but a
    # projection over 20 steps saves 10 s, under the 2 x 10 s bar): reported, kept, and the
    # step its slowness began is recorded.
    st, statuses = running(1.0)
    j = with_policy(swap_cost_s=10)
    first = decide(NOW, view(status=st, spares=("s",), node_status=statuses, j=j))
    assert not any(isinstance(a, RequestDrain) for a in first.actions)
    flagged = only(first.actions, SetStatus).status
    assert flagged.stragglers["b"]["since_step"] == 80
    assert "does not pay" in only(first.actions, Emit).message
    # Still slow 100 steps later: slow for 120 steps, projected over 120 it saves 60 s.
    st2, statuses2 = running(1.0, step=200)
    st2 = dataclasses.replace(st2, stragglers=flagged.stragglers)
    d = decide(NOW, view(status=st2, spares=("s",), node_status=statuses2, j=j))
    assert only(d.actions, RequestDrain).node == "b"
    ev = only(d.actions, Emit)
    assert ev.kind == "straggler" and ev.fields["culprit"] == "b"
    assert ev.fields["ratio"] == pytest.approx(2.0) and ev.fields["swap_to"] == "s"
    assert "slow for 120 steps" in ev.message and "over the next 120 steps" in ev.message
    assert "swap in s" in d.reason


def test_a_passing_burst_in_a_long_job_never_earns_a_swap():
    # What a transient load did once: 1.41x in 15 of 20 steps of a job with 99,470 steps
    # left. Extrapolated over the rest of the run that "saved ~1657 s"; over what was seen,
    # nothing close to the swap's cost.
    st, statuses = running(0.705, a_compute=0.5, step=530)
    st = dataclasses.replace(st, stragglers={})
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses,
                         j=with_policy(steps=100_000)))
    assert not any(isinstance(a, RequestDrain) for a in d.actions)
    assert "does not pay yet" in only(d.actions, Emit).message


def test_a_straggler_hovering_at_the_bar_keeps_its_record():
    # 1.15x: under the 1.2 bar of a report, over the 1.1 of "clearly back": the node keeps
    # the step its slowness began, so the time it has been slow keeps counting.
    st, statuses = running(0.575)
    st = dataclasses.replace(st, stragglers={"b": {"round": 1, "reason": "x", "since_step": 3}})
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses, j=with_policy()))
    assert not any(isinstance(a, SetStatus) for a in d.actions)


def test_a_straggler_no_longer_slow_is_forgotten_so_its_evidence_starts_again():
    st, statuses = running(0.5)   # b back at its peers' pace
    st = dataclasses.replace(st, stragglers={"b": {"round": 1, "reason": "x", "since_step": 3}})
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses, j=with_policy()))
    assert only(d.actions, SetStatus).status.stragglers == {}
    assert "b no longer slow" in d.reason


def test_straggler_without_a_spare_is_reported_once_per_round_and_kept():
    st, statuses = running(1.0)
    d = decide(NOW, view(status=st, node_status=statuses, j=with_policy(swap_cost_s=10)))
    flagged = only(d.actions, SetStatus).status
    assert flagged.stragglers == {"b": {"round": 1, "reason": flagged.stragglers["b"]["reason"],
                                        "since_step": 80}}
    assert "no spare idle: kept" in only(d.actions, Emit).message
    again = decide(NOW, view(status=flagged, node_status=statuses, j=with_policy(swap_cost_s=10)))
    assert not any(isinstance(a, Emit) and a.kind == "straggler" for a in again.actions)


def test_a_swap_that_does_not_pay_keeps_the_node_and_says_why():
    st, statuses = running(1.0, step=990)   # 10 steps left: saves ~5 s, costs 60 s
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses, j=with_policy()))
    assert not any(isinstance(a, RequestDrain) for a in d.actions)
    assert "does not pay" in only(d.actions, Emit).message


def test_peers_within_the_margin_and_other_rounds_are_no_stragglers():
    st, statuses = running(0.55)            # 1.1x: inside the default 1.2 margin
    assert decide(NOW, view(status=st, spares=("s",), node_status=statuses)).actions == []
    st, statuses = running(1.0)
    stale = [dataclasses.replace(s, round=0) for s in statuses]  # a previous round's numbers
    assert decide(NOW, view(status=st, spares=("s",), node_status=stale)).actions == []


def test_garbage_throughput_is_no_evidence():
    st, statuses = running(1.0)
    junk = dataclasses.replace(statuses[1], throughput={"ranks": {"2": {"steps": "fast"},
                                                                  "x": 7}})
    assert decide(NOW, view(status=st, spares=("s",), node_status=[statuses[0], junk],
                            j=with_policy(swap_cost_s=10))).actions == []


@pytest.mark.parametrize("gain,cost,remaining,slow,step_s,pays", [
    (0.5, 60.0, 1000, 1000, 1.0, True),   # slow 1000 s; saves 500 s for 60 s (x2: 120)
    (0.5, 60.0, 200, 1000, 1.0, False),   # 200 steps left: saves 100 s, under 120
    (0.5, 60.0, 10**6, 200, 1.0, False),  # slow 200 steps: projected over 200, 100 s
    (0.5, 60.0, 10**6, 50, 1.0, False),   # slow 50 s, less than a swap costs: not yet
    (0.0, 1.0, 10**6, 10**6, 1.0, False), # nothing to gain
    (0.1, 30.0, 600, 600, 1.0, False),    # saves 60 s = exactly 2 x cost: not strictly better
])
def test_swap_pays(gain, cost, remaining, slow, step_s, pays):
    ok, reason = swap_pays(gain, cost, remaining, slow_steps=slow, step_s=step_s)
    assert ok is pays
    assert ("pays" if pays else "does not pay") in reason


@pytest.mark.parametrize("policy,problem", [
    ({"straggler_margin": 1.0}, "straggler_margin must be a number above 1"),
    ({"straggler_margin": "big"}, "straggler_margin"),
    ({"straggler_margin": float("nan")}, "straggler_margin must be a number above 1"),
    ({"swap_cost_s": float("nan")}, "swap_cost_s must be a non-negative number"),
    ({"straggler_steps": 0}, "straggler_steps must be an integer in [1, 20]"),
    ({"straggler_steps": 21}, "straggler_steps"),
    ({"swap_cost_s": -1}, "swap_cost_s must be a non-negative number"),
    ({"swap_cost": 5}, "unknown key(s) in [policy]: ['swap_cost']"),
])
def test_bad_straggler_policy_is_one_clear_error(policy, problem):
    with pytest.raises(UserError) as e:
        with_policy(**policy)
    assert problem in str(e.value)


def test_policy_defaults_are_filled_in():
    pol = with_policy().straggler_policy
    assert (pol.straggler_margin, pol.straggler_steps, pol.swap_cost_s) == (1.2, 14, 60.0)
    assert ThroughputConfig().window == 20


def test_a_garbled_straggler_memo_in_run_status_is_reported_over():
    st, statuses = running(1.0)
    st = dataclasses.replace(st, stragglers={"b": 5, "a": "?"})
    d = decide(NOW, view(status=st, node_status=statuses, j=with_policy(swap_cost_s=10)))
    assert only(d.actions, SetStatus).status.stragglers["b"]["round"] == 1


def test_non_finite_numbers_in_a_summary_are_no_evidence_and_no_crash():
    st, statuses = running(1.0)
    st = dataclasses.replace(st, stragglers={"b": {"round": 1, "reason": "x", "since_step": 0}})
    doc = statuses[1].throughput
    doc["ranks"]["2"]["work_s"][0] = float("inf")
    doc["ranks"]["3"]["work_s"] = [1e999, float("nan")] * 10
    doc["ranks"]["3"]["p50_s"] = float("nan")
    d = decide(NOW, view(status=st, spares=("s",), node_status=statuses,
                         j=with_policy(swap_cost_s=10)))
    # rank 2's other 19 steps still show it slow; rank 3's garbage is ignored
    assert only(d.actions, RequestDrain).node == "b"


def test_two_stragglers_do_not_share_one_spare():
    st, statuses = running(1.0)
    v = view(status=st, spares=("s",), node_status=statuses, j=with_policy(swap_cost_s=10))
    v.drains = {"a": 7}     # a drain of a waits for its checkpoint: s is promised to it
    d = decide(NOW, v)
    assert not any(isinstance(a, RequestDrain) for a in d.actions)
