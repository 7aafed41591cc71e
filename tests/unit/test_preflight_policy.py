"""The daemon's side of preflight, table-driven: a node that failed its checks is cordoned
with the reason and never chosen; one still checking is not chosen; a passed check lifts the
leader's cordon and never an operator's."""

from __future__ import annotations

import dataclasses

from lazarus.core.records import PENDING, RECOVERING, RUNNING, W_FAILED, W_RUNNING
from lazarus.daemon import health
from lazarus.daemon.actions import Cordon, Emit, StartRound, Uncordon
from lazarus.daemon.decide import decide
from lazarus.daemon.executor import operations
from lazarus.core.records import Keys
from lazarus.daemon.view import _cordon_by
from tests.unit.test_decide import NOW, kinds, node, ns, only, status, view

FAILED_DISK = {"state": "failed", "at": NOW - 5, "cost_s": 1.2,
               "reason": "storage: /ckpt: EROFS: Read-only file system"}
PASSED = {"state": "passed", "at": NOW - 5, "cost_s": 1.1, "reason": ""}


def idle(name, preflight):
    return ns(name, "idle", round=0, preflight=preflight)


def test_a_spare_that_failed_preflight_is_cordoned_with_the_reason():
    v = view(status=status(RUNNING, members=("a", "b")), spares=("s",),
             node_status=[ns("a", W_RUNNING), ns("b", W_RUNNING), idle("s", FAILED_DISK)])
    d = decide(NOW, v)
    assert kinds(d.actions)[:2] == ["Cordon", "Emit:preflight_failed"]
    cordon = only(d.actions, Cordon)
    assert (cordon.node, cordon.by) == ("s", "preflight")
    assert cordon.reason == FAILED_DISK["reason"]
    event = next(a for a in d.actions if isinstance(a, Emit))
    assert event.message == f"s failed its preflight: {FAILED_DISK['reason']}; cordoned"
    assert event.fields["culprit"] == "s"
    # written as the leader's cordon, which the view reads back as such
    ops = operations(Keys(), d, v, now=NOW, writer="d")
    assert _cordon_by(ops[0].value) == ("preflight", FAILED_DISK["reason"])


def test_a_failed_node_is_not_promoted_even_before_its_cordon_lands():
    st = status(RECOVERING, members=("a", "b"))
    v = view(status=st, nodes=("a",), spares=("s", "t"),
             node_status=[ns("a", W_FAILED), idle("s", FAILED_DISK), idle("t", PASSED)])
    d = decide(NOW, v)
    assert only(d.actions, StartRound).record.members == ["a", "t"]
    assert only(d.actions, Cordon).node == "s"


def test_a_node_whose_checks_are_under_way_waits():
    v = view(status=status(PENDING, round=0, members=()), nodes=("a", "b"))
    v.nodes["b"] = dataclasses.replace(node("b"), preflight=True)   # no status yet
    d = decide(NOW, v)
    assert d.actions == [] and "waiting for nodes: 1 of 2" in d.reason
    v.node_status = {"b": idle("b", PASSED)}
    assert only(decide(NOW, v).actions, StartRound).record.members == ["a", "b"]


def test_a_passed_preflight_lifts_the_leaders_cordon_not_an_operators():
    v = view(status=status(RUNNING), spares=("s", "o"), cordoned=("s", "o"),
             node_status=[ns("a", W_RUNNING), ns("b", W_RUNNING), idle("s", PASSED),
                          idle("o", PASSED)])
    v.cordon_by = {"s": "preflight"}
    d = decide(NOW, v)
    assert only(d.actions, Uncordon).node == "s"
    assert "Emit:preflight_passed" in kinds(d.actions)
    # still failing and cordoned: nothing to do, every pass
    v.node_status["s"] = idle("s", FAILED_DISK)
    assert not any(isinstance(a, (Cordon, Uncordon)) for a in decide(NOW, v).actions)


def test_garbage_in_a_status_preflight_is_no_verdict():
    v = view(status=status(RUNNING), spares=("s",),
             node_status=[ns("a", W_RUNNING), ns("b", W_RUNNING),
                          idle("s", {"state": ["failed"], "reason": 7, "cost_s": "x"})])
    d = decide(NOW, v)
    assert not any(isinstance(a, Cordon) for a in d.actions)


def test_lazarus_nodes_shows_the_reason():
    v = view(status=status(RUNNING), spares=("s",), cordoned=("s",),
             node_status=[ns("a", W_RUNNING), ns("b", W_RUNNING), idle("s", FAILED_DISK)])
    nodes = {n.node: n for n in health.list_nodes(v, now=NOW)}
    assert nodes["s"].state == "cordoned"
    verdict = next(h for h in nodes["s"].health if h.monitor == "preflight")
    assert (verdict.state, list(verdict.reasons)) == ("failed", [FAILED_DISK["reason"]])
    assert not any(h.monitor == "preflight" for h in nodes["a"].health)  # it runs none
    # Any cordon with a reason shows it (a node that alone could not read a checkpoint);
    # one that is lifted shows none.
    v = dataclasses.replace(v, cordon_reason={"s": "ckpt unreadable", "a": "stale"})
    nodes = {n.node: n for n in health.list_nodes(v, now=NOW)}
    assert (nodes["s"].cordon_reason, nodes["a"].cordon_reason) == ("ckpt unreadable", "")


def test_the_first_round_waits_for_an_active_nodes_checks_rather_than_take_a_spare():
    v = view(status=status(PENDING, round=0, members=()), nodes=("a", "b"), spares=("s",),
             node_status=[idle("a", PASSED), idle("s", PASSED)])
    v.nodes["b"] = dataclasses.replace(node("b"), preflight=True)
    d = decide(NOW, v)
    assert d.actions == [] and d.reason == ("waiting for the preflight of b before using "
                                            "spare(s) s")
    # not for ever: past the rendezvous timeout the spare is used
    late = dataclasses.replace(v, status=status(PENDING, round=0, members=(), since=NOW - 31))
    assert only(decide(NOW, late).actions, StartRound).record.members == ["a", "s"]
