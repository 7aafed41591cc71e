"""Operator commands as policy: drain, pause/resume, cancel (table tests of decide())."""

from __future__ import annotations


from lazarus.daemon.actions import (ClearCommand, Cordon, Emit, RequestCheckpoint, SetStatus,
                                    StartRound)
from lazarus.daemon.decide import decide
from lazarus.core.records import CANCELLED, PAUSED, RENDEZVOUS, RUNNING, CheckpointRecord

from tests.unit.test_decide import NOW, kinds, only, status, view


def ckpt(step, rev, view_):
    view_.checkpoints.append(CheckpointRecord(step=step, path=f"/c/{step}", round=1, job_id="J"))
    view_.checkpoint_revision[step] = rev


def test_cancel_ends_the_run_and_clears_the_command():
    v = view(status=status(RUNNING))
    v.cancel_requested = True
    d = decide(NOW, v)
    assert only(d.actions, SetStatus).status.state == CANCELLED
    assert ClearCommand("cancel") in d.actions


def test_drain_of_an_idle_node_cordons_it_at_once():
    v = view(status=status(RUNNING), nodes=("a", "b", "c"))
    v.drains = {"c": 50}
    d = decide(NOW, v)
    assert Cordon("c") in d.actions and ClearCommand("drain/c") in d.actions


def test_drain_of_a_member_checkpoints_first_then_swaps_in_the_spare():
    v = view(status=status(RUNNING), spares=("s",))
    v.drains = {"b": 50}
    ckpt(8, 40, v)                       # committed before the drain: does not count
    d = decide(NOW, v)
    assert kinds(d.actions) == ["RequestCheckpoint"]
    v.checkpoint_request_revision = 51
    assert decide(NOW, v).actions == []  # requested, waiting for the commit
    ckpt(12, 60, v)
    d = decide(NOW, v)
    rec = only(d.actions, StartRound).record
    assert rec.members == ["a", "s"] and rec.restore_step == 12
    assert Cordon("b") in d.actions and ClearCommand("drain/b") in d.actions


def test_drain_waits_for_a_spare_still_in_its_preflight_rather_than_shrink():
    """tests/e2e/test_operator.py on a busy machine: the spare registered, its preflight took
    27 s, and a drain at 24 s shrank the run to one node instead of waiting for it."""
    import dataclasses

    from lazarus.core.records import NodeStatus
    v = view(status=status(RUNNING), spares=("s",))
    v.nodes["s"] = dataclasses.replace(v.nodes["s"], preflight=True, started_at=NOW - 24)
    v.drains = {"b": 50}
    ckpt(12, 60, v)
    d = decide(NOW, v)
    assert d.actions == [] and "waiting for the preflight of s rather than shrink" in d.reason
    # passed: swapped in
    v.node_status["s"] = NodeStatus(node="s", round=0, workers="idle",
                                    preflight={"state": "passed", "at": NOW - 1})
    assert only(decide(NOW, v).actions, StartRound).record.members == ["a", "s"]
    # still checking past the wait: the run shrinks rather than wait on it for good
    del v.node_status["s"]
    d = decide(NOW + 40, v)
    assert only(d.actions, StartRound).record.members == ["a"]


def test_drain_below_min_nodes_waits_for_a_spare():
    from tests.unit.test_decide import job
    v = view(status=status(RUNNING), j=job(min_nodes=2))
    v.drains = {"b": 50}
    ckpt(12, 60, v)
    d = decide(NOW, v)
    assert d.actions == [] and "below min_nodes" in d.reason


def test_pause_after_a_checkpoint_and_resume_from_it():
    v = view(status=status(RUNNING))
    v.pause_revision = 70
    assert isinstance(decide(NOW, v).actions[0], RequestCheckpoint)
    ckpt(16, 75, v)
    st = only(decide(NOW, v).actions, SetStatus).status
    assert st.state == PAUSED and st.restore_step == 16
    v2 = view(status=st)
    v2.pause_revision = 70
    ckpt(16, 75, v2)
    assert decide(NOW, v2).actions == []
    v2.pause_revision = None               # lazarus resume
    d = decide(NOW, v2)
    rec = only(d.actions, StartRound).record
    assert rec.restore_step == 16 and only(d.actions, SetStatus).status.state == RENDEZVOUS


def test_a_fault_while_draining_is_handled_first():
    v = view(status=status(RUNNING), nodes=("a",))
    v.drains = {"a": 50}
    st = only(decide(NOW, v).actions, SetStatus).status
    assert st.incident["kind"] == "node_lost"
    assert not any(isinstance(a, Emit) and a.kind == "drained" for a in decide(NOW, v).actions)


def test_a_cancel_meant_for_another_run_is_dropped():
    v = view(status=status(RUNNING))
    v.cancel_requested, v.cancel_job_id = True, "OLD"
    d = decide(NOW, v)
    assert ClearCommand("cancel") in d.actions
    assert not any(isinstance(a, SetStatus) for a in d.actions)
