"""Table-driven tests of the controller policy: preload a view, call decide(), assert actions."""

from __future__ import annotations

import dataclasses

import pytest

from lazarus.core import jobspec
from lazarus.daemon.actions import AcceptJob, Emit, SetStatus, StartRound
from lazarus.daemon.decide import decide
from lazarus.daemon.view import ClusterView
from lazarus.core import settings
from lazarus.core.records import (FAILED, PENDING, RECOVERING, RENDEZVOUS, RUNNING, SUCCEEDED,
                             CheckpointRecord, NodeRecord, NodeStatus, RoundRecord, RunStatus)

NOW = 1000.0


def job(**kw) -> jobspec.JobSpec:
    j = {"name": "t", "nodes": 2, "min_nodes": 1, "nproc_per_node": 2, "id": "J",
         "rendezvous_timeout_s": 30, "max_restarts": 3, **kw}
    return jobspec.from_dict({"job": j, "train": {"steps": 10, "model": {"name": "tiny"},
                                                  "data": {"global_batch": 8}}}, source="test")


def node(name, role="active", nproc=2):
    return NodeRecord(node=name, host="127.0.0.1", nproc=nproc, role=role, store_port=1000)


def view(*, status=None, nodes=("a", "b"), spares=(), node_status=(), ckpts=(), cordoned=(),
         j=None, submitted=None) -> ClusterView:
    j = j or job()
    v = ClusterView(revision=10, submitted=submitted or j, job=j, status=status,
                    status_mod_revision=5 if status else 0)
    v.nodes = {n: node(n) for n in nodes} | {n: node(n, "spare") for n in spares}
    v.node_status = {s.node: s for s in node_status}
    v.checkpoints = sorted(ckpts, key=lambda c: c.step)
    v.cordoned = set(cordoned)
    v.last_round = status.round if status else 0
    return v


def status(state, *, round=1, members=("a", "b"), since=NOW - 1, **kw) -> RunStatus:
    return RunStatus(job_id="J", state=state, round=round, members=list(members), since=since,
                     **kw)


def ns(name, workers, *, round=1, step=0, **kw) -> NodeStatus:
    return NodeStatus(node=name, round=round, workers=workers, step=step, **kw)


def kinds(actions):
    return [type(a).__name__ + (f":{a.kind}" if isinstance(a, Emit) else "") for a in actions]


def only(actions, cls):
    found = [a for a in actions if isinstance(a, cls)]
    assert len(found) == 1, actions
    return found[0]


def test_new_job_is_accepted_into_pending():
    d = decide(NOW, view(status=None))
    assert kinds(d.actions) == ["AcceptJob", "SetStatus", "Emit:job_accepted"]
    assert only(d.actions, SetStatus).status.state == PENDING
    assert only(d.actions, AcceptJob).job.id == "J"


def test_second_job_waits_while_a_run_is_active():
    other = dataclasses.replace(job(), id="K")
    d = decide(NOW, view(status=status(RUNNING), submitted=other))
    assert d.actions == [] and "waits" in d.reason


def test_new_job_replaces_a_finished_run():
    other = dataclasses.replace(job(), id="K")
    d = decide(NOW, view(status=status(SUCCEEDED), submitted=other))
    assert only(d.actions, AcceptJob).job.id == "K"


@pytest.mark.parametrize("nodes, spares, waited, expect_members", [
    (("a", "b"), (), 1, ["a", "b"]),          # enough nodes: start at once
    (("a",), (), 1, None),                    # too few, timeout not reached: wait
    (("a",), (), 31, ["a"]),                  # too few but >= min after the timeout: start
    (("a",), ("s",), 1, ["a", "s"]),          # a spare fills in for a missing active
    (("b", "a", "c"), (), 1, ["a", "b"]),     # more than needed: sorted, the rest stay idle
])
def test_pending_starts_the_first_round(nodes, spares, waited, expect_members):
    st = RunStatus(job_id="J", state=PENDING, since=NOW - waited)
    d = decide(NOW, view(status=st, nodes=nodes, spares=spares))
    if expect_members is None:
        assert d.actions == [] and "waiting for nodes" in d.reason
        return
    rec = only(d.actions, StartRound).record
    assert rec.members == expect_members and rec.round == 1
    assert rec.world_size == 2 * len(expect_members) and rec.dp == rec.world_size
    assert rec.restore is None
    assert only(d.actions, SetStatus).status.state == RENDEZVOUS


def test_rendezvous_becomes_running_when_every_member_steps():
    v = view(status=status(RENDEZVOUS), node_status=[ns("a", "running", step=1),
                                                      ns("b", "starting")])
    assert decide(NOW, v).actions == []
    v.node_status["b"] = ns("b", "running", step=1)
    d = decide(NOW, v)
    assert only(d.actions, SetStatus).status.state == RUNNING


def test_status_of_an_older_round_does_not_count():
    v = view(status=status(RENDEZVOUS, round=2), node_status=[ns("a", "running", round=1, step=9),
                                                               ns("b", "running", round=2, step=3)])
    assert decide(NOW, v).actions == []


def test_worker_crash_keeps_the_members_and_restores_the_last_checkpoint():
    ck = [CheckpointRecord(step=5, path="/c/5", round=1, job_id="J"),
          CheckpointRecord(step=10, path="/c/10", round=1, job_id="J"),
          CheckpointRecord(step=20, path="/other/20", round=1, job_id="OTHER")]
    v = view(status=status(RUNNING), ckpts=ck,
             node_status=[ns("a", "running", step=12),
                          ns("b", "failed", failed_rank=3, exit_codes={"1": -9}, fault_at=NOW - 0.2)])
    d = decide(NOW, v)
    st = only(d.actions, SetStatus).status
    assert st.state == RECOVERING and st.incident["kind"] == "worker_crash"
    assert st.incident["culprit"] == "b" and st.incident["fault_at"] == NOW - 0.2
    # next pass: same members, new round, restore step 10
    v2 = view(status=st, ckpts=ck, node_status=v.node_status.values())
    d2 = decide(NOW + 0.1, v2)
    rec = only(d2.actions, StartRound).record
    assert rec.members == ["a", "b"] and rec.round == 2
    assert (rec.restore, rec.restore_step) == ("/c/10", 10)
    assert only(d2.actions, SetStatus).status.restarts == 1


def test_lost_node_is_replaced_by_a_spare():
    st = status(RUNNING)
    v = view(status=st, nodes=("a",), spares=("s",))
    d = decide(NOW, v)
    st2 = only(d.actions, SetStatus).status
    assert st2.state == RECOVERING and st2.incident["kind"] == "node_lost"
    assert st2.incident["culprit"] == "b"
    # dated when its agent was last heard of: one lease TTL before the loss is seen (its
    # registration's TTL, the default when the daemon never saw it go)
    assert NOW - st2.incident["fault_at"] == settings.LEASE_TTL_S
    v.departed_ttl = {"b": 10}
    assert NOW - only(decide(NOW, v).actions, SetStatus).status.incident["fault_at"] == 10
    rec = only(decide(NOW, view(status=st2, nodes=("a",), spares=("s",))).actions,
               StartRound).record
    assert rec.members == ["a", "s"]


def test_no_spare_shrinks_to_min_nodes_with_the_same_global_batch():
    st = dataclasses.replace(status(RUNNING), state=RECOVERING)
    rec = only(decide(NOW, view(status=st, nodes=("a",))).actions, StartRound).record
    assert rec.members == ["a"] and rec.dp == 2 and rec.train["data"]["global_batch"] == 8


def test_below_min_nodes_waits_then_fails():
    j = job(min_nodes=2)
    st = dataclasses.replace(status(RUNNING), state=RECOVERING, since=NOW - 5)
    d = decide(NOW, view(status=st, nodes=("a",), j=j))
    assert d.actions == [] and "need 2" in d.reason
    st = dataclasses.replace(st, since=NOW - 31)
    d = decide(NOW, view(status=st, nodes=("a",), j=j))
    assert only(d.actions, SetStatus).status.state == FAILED


def test_max_restarts_fails_the_run():
    st = dataclasses.replace(status(RECOVERING), restarts=3)
    assert only(decide(NOW, view(status=st)).actions, SetStatus).status.state == FAILED


def test_cordoned_node_is_not_chosen():
    st = RunStatus(job_id="J", state=PENDING, since=NOW)
    rec = only(decide(NOW, view(status=st, nodes=("a", "b", "c"), cordoned=("a",))).actions,
               StartRound).record
    assert rec.members == ["b", "c"]


def test_node_with_too_few_ranks_is_not_chosen():
    st = RunStatus(job_id="J", state=PENDING, since=NOW)
    v = view(status=st, nodes=("a", "b", "c"))
    v.nodes["a"] = node("a", nproc=1)
    assert only(decide(NOW, v).actions, StartRound).record.members == ["b", "c"]


def test_recovered_event_after_the_first_new_step():
    inc = {"kind": "worker_crash", "culprit": "b", "fault_at": NOW - 3, "detected_at": NOW - 2.9,
           "round": 1}
    st = status(RUNNING, round=2, incident=inc, restore_step=10)
    v = view(status=st, node_status=[ns("a", "running", round=2, step=10),
                                     ns("b", "running", round=2, step=10)])
    assert decide(NOW, v).actions == []
    v.node_status["a"] = ns("a", "running", round=2, step=11)
    d = decide(NOW, v)
    ev = only(d.actions, Emit)
    assert ev.kind == "recovered" and ev.fields["recovered_after_s"] == 3.0
    assert ev.fields["in_place_ranks"] == 0 and "in place" not in ev.message
    assert only(d.actions, SetStatus).status.incident is None


def test_the_recovery_is_timed_to_the_status_that_told_of_the_new_step():
    """Not to the daemon's pass that read it, a watch event and a pass interval later; a
    time from another host's clock outside the fault .. now is the pass's own."""
    inc = {"kind": "worker_crash", "culprit": "b", "fault_at": NOW - 3, "detected_at": NOW - 2.9,
           "round": 1}
    st = status(RUNNING, round=2, incident=inc, restore_step=10)
    for told_at, after in ((NOW - 0.6, 2.4), (NOW + 5, 3.0), (NOW - 4, 3.0)):
        v = view(status=st, node_status=[ns("a", "running", round=2, step=11,
                                            updated_at=told_at),
                                         ns("b", "running", round=2, step=10)])
        ev = only(decide(NOW, v).actions, Emit)
        assert ev.fields["recovered_after_s"] == after, told_at
        assert ev.fields["recovered_at"] == NOW
        assert f"{after:.1f} s after the fault" in ev.message


def test_the_recovered_event_counts_the_ranks_that_went_on_in_place():
    inc = {"kind": "worker_crash", "culprit": "b", "fault_at": NOW - 3, "detected_at": NOW - 2.9,
           "round": 1}
    st = status(RUNNING, round=2, incident=inc, restore_step=10)
    v = view(status=st, node_status=[ns("a", "running", round=2, step=11, pids=[7, 8],
                                        in_place=[0, 1]),
                                     ns("b", "running", round=2, step=11, pids=[9, 10],
                                        anew={"failed first": [3],
                                              "exited with the round": [2]})])
    ev = only(decide(NOW, v).actions, Emit)
    assert ev.fields["in_place_ranks"] == 2 and ev.fields["path"] == "in_place"
    assert ev.fields["anew"] == {"failed first": 1, "exited with the round": 1}
    assert ev.message.endswith("3.0 s after the fault; 2 of 4 rank(s) in place; rank 2 started "
                               "anew (exited with the round); rank 3 started anew (failed "
                               "first)"), ev.message


def test_the_recovered_event_says_why_ranks_started_anew_within_a_bound():
    """A process restart of every rank (in place off, or 4,096 nodes' worth) is counted by
    reason; the event lists a few ranks of each, never all."""
    inc = {"kind": "hang", "culprit": "b", "fault_at": NOW - 3, "detected_at": NOW - 2.9,
           "round": 1}
    st = status(RUNNING, round=2, incident=inc, restore_step=10)
    v = view(status=st, node_status=[
        ns("a", "running", round=2, step=11, pids=list(range(8)),
           anew={"exited on a lost peer": list(range(8))}),
        ns("b", "running", round=2, step=11, pids=list(range(8, 16)),
           anew={"stopped with the round": [8], "exited on a lost peer": list(range(9, 16))})])
    ev = only(decide(NOW, v).actions, Emit)
    assert ev.fields["path"] == "restart" and ev.fields["in_place_ranks"] == 0
    assert ev.fields["anew"] == {"exited on a lost peer": 15, "stopped with the round": 1}
    assert ev.fields["anew_ranks"]["exited on a lost peer"] == list(range(8))
    assert ev.message.endswith("after the fault; rank 8 started anew (stopped with the round); "
                               "15 ranks started anew (exited on a lost peer)"), ev.message


def test_all_members_succeeded_ends_the_run():
    v = view(status=status(RUNNING), node_status=[ns("a", "succeeded", step=10),
                                                  ns("b", "succeeded", step=10)])
    assert only(decide(NOW, v).actions, SetStatus).status.state == SUCCEEDED


def test_returning_node_joins_at_the_next_checkpoint_of_the_round():
    st = status(RUNNING, round=3, members=("a",), restore_step=10)
    base = dict(status=st, nodes=("a", "b"),
                node_status=[ns("a", "running", round=3, step=14)])
    assert decide(NOW, view(**base, ckpts=[CheckpointRecord(step=10, path="/c/10", round=2, job_id="J")])
                  ).actions == []
    d = decide(NOW, view(**base, ckpts=[CheckpointRecord(step=15, path="/c/15", round=3, job_id="J")]))
    rec = only(d.actions, StartRound).record
    assert rec.members == ["a", "b"] and rec.restore_step == 15 and rec.round == 4


def test_rendezvous_timeout_treats_missing_members_as_faulty():
    st = status(RENDEZVOUS, since=NOW - 31)
    v = view(status=st, node_status=[ns("a", "running", step=1)])
    d = decide(NOW, v)
    st2 = only(d.actions, SetStatus).status
    assert st2.state == RECOVERING and st2.incident["culprit"] == "b"


def test_deciding_twice_on_the_same_view_gives_the_same_actions():
    v = view(status=status(RUNNING), nodes=("a",), spares=("s",))
    assert decide(NOW, v) == decide(NOW, v)


def test_terminal_run_does_nothing():
    assert decide(NOW, view(status=status(FAILED))).actions == []


def test_missing_accepted_job_does_not_crash():
    v = view(status=status(RUNNING))
    v.job = None
    d = decide(NOW, v)
    assert d.actions == [] and "missing or unreadable" in d.reason


def test_unreadable_status_is_rebuilt_from_the_round_records():
    v = view(status=None)
    v.status_garbled = True
    v.latest_round = RoundRecord(round=4, job_id="J", members=["a", "b"], nproc_per_node=2,
                                 world_size=4, dp=4, tp=1, store_host="h", store_port=1)
    v.last_round = 4
    d = decide(NOW, v)
    st = only(d.actions, SetStatus).status
    assert (st.state, st.round, st.members) == (RECOVERING, 4, ["a", "b"])
    rec = only(decide(NOW, view(status=st)).actions, StartRound).record
    assert rec.round == 5


def test_unreadable_status_without_rounds_waits_for_a_person():
    v = view(status=None)
    v.status_garbled = True
    d = decide(NOW, v)
    assert d.actions == [] and "unreadable" in d.reason


def test_peer_lost_waits_for_the_root_cause_then_names_the_lost_node():
    # n1's host died: n0's rank failed in a collective (peer lost) before n1's lease expired
    fault = ns("a", "failed", exit_codes={"0": 75}, failed_rank=0, fault_at=NOW - 1)
    v = view(status=status(RUNNING), node_status=[fault])
    d = decide(NOW, v)
    assert d.actions == [] and "waiting for the root cause" in d.reason
    v.nodes.pop("b")  # lease expired
    st = only(decide(NOW, v).actions, SetStatus).status
    assert st.incident["kind"] == "node_lost" and st.incident["culprit"] == "b"


def test_peer_lost_with_a_crashed_rank_names_the_crashed_one():
    v = view(status=status(RUNNING), node_status=[
        ns("a", "failed", exit_codes={"0": 75}, failed_rank=0, fault_at=NOW - 0.5),
        ns("b", "failed", exit_codes={"0": -9}, failed_rank=1, fault_at=NOW - 0.6)])
    st = only(decide(NOW, v).actions, SetStatus).status
    assert st.incident["kind"] == "worker_crash" and st.incident["culprit"] == "b"


def test_peer_lost_with_no_root_cause_recovers_after_the_grace():
    v = view(status=status(RUNNING), node_status=[
        ns("a", "failed", exit_codes={"0": 75}, failed_rank=0, fault_at=NOW - 7)])
    st = only(decide(NOW, v).actions, SetStatus).status
    assert st.incident["kind"] == "peer_lost"


def test_a_submission_with_impossible_sizes_is_rejected_not_accepted():
    bad = dataclasses.replace(job(), id="BAD", train={"data": {"global_batch": 3}})
    d = decide(NOW, view(status=None, submitted=bad))
    assert kinds(d.actions) == ["RejectJob", "Emit:job_rejected"]
    assert "global" in d.reason or "batch" in d.reason


def _gpu(state, reasons=("Xid 79: GPU fell off the bus",)):
    return {"state": state, "gpu": {"backend": "sim", "state": state,
                                    "gpus": [{"index": 0, "state": state,
                                              "reasons": list(reasons)}]}}


def test_failed_gpu_cordons_the_node_and_swaps_in_a_spare():
    v = view(status=status(RUNNING), spares=("s",),
             node_status=[ns("a", "running", step=5), ns("b", "running", step=5,
                                                         health=_gpu("failed"))])
    d = decide(NOW, v)
    from lazarus.daemon.actions import Cordon
    assert Cordon("b") in d.actions
    st = only(d.actions, SetStatus).status
    assert st.incident["kind"] == "gpu_failed" and "Xid 79" in st.reason
    v2 = view(status=st, spares=("s",), cordoned=("b",))
    assert only(decide(NOW, v2).actions, StartRound).record.members == ["a", "s"]


def test_degraded_gpu_asks_for_a_planned_swap_only_when_a_spare_is_idle():
    from lazarus.daemon.actions import RequestDrain
    sick = ns("b", "running", step=5, health=_gpu("degraded", ["correctable ECC rising"]))
    d = decide(NOW, view(status=status(RUNNING), spares=("s",), node_status=[sick]))
    assert only(d.actions, RequestDrain).node == "b"
    assert decide(NOW, view(status=status(RUNNING), node_status=[sick])).actions == []


def test_garbage_health_reads_as_healthy():
    junk = ns("b", "running", step=5, health={"gpu": "on fire", "host": [1, 2]})
    assert decide(NOW, view(status=status(RUNNING), spares=("s",), node_status=[junk])
                  ).actions == []


def _hang_report(at, positions, reason="stalled"):
    return {"culprits": [], "reason": reason, "stalled_s": 12.0, "timeout_s": 10.0,
            "at": at, "stacks": "/w/hangs/x.txt",
            "positions": {str(r): {"step": st, "phase": ph, "seq": seq, "stalled_s": 12.0,
                                   "op": ""} for r, (st, ph, seq) in positions.items()}}


def test_hang_waits_for_all_reports_then_names_the_rank_behind():
    a = ns("a", "running", step=9, hang=_hang_report(NOW - 1, {0: (9, "collective", 40)}))
    v = view(status=status(RUNNING), node_status=[a, ns("b", "running", step=9)])
    d = decide(NOW, v)
    assert d.actions == [] and "waiting for the others" in d.reason
    v.node_status["b"] = ns("b", "running", step=9, hang=_hang_report(
        NOW - 0.5, {1: (9, "optimizer", 38)}, reason="no progress for 12.0 s (allowance "
        "10.0 s = the 10 s floor (3 x 0.20 s, the lower quartile)): rank 1 is behind"))
    st = only(decide(NOW, v).actions, SetStatus).status
    assert st.incident["kind"] == "hang" and st.incident["culprit"] == "b"
    assert st.incident["fault_at"] == NOW - 1 - 12.0
    # the culprit's agent said how long its ranks had, and from what
    assert ("; allowance on b: 10.0 s = the 10 s floor (3 x 0.20 s, the lower quartile) "
            "(stacks: ") in st.reason, st.reason


def test_a_lone_hang_report_waits_out_a_stack_capture_then_blames_the_silent_node():
    # b's agent may still be waiting on a stopped rank's stacks (a whole capture) -- then acts:
    # a's ranks all wait level, so the rank they wait for is on b, not on a
    a = ns("a", "running", step=9, hang=_hang_report(NOW - 4, {0: (9, "collective", 40)}))
    d = decide(NOW, view(status=status(RUNNING), node_status=[a]))
    assert d.actions == [] and "waiting for the others" in d.reason
    a = ns("a", "running", step=9, hang=_hang_report(NOW - 6, {0: (9, "collective", 40)}))
    st = only(decide(NOW, view(status=status(RUNNING), node_status=[a])).actions,
              SetStatus).status
    assert st.incident["kind"] == "hang" and st.incident["culprit"] == "b"
    assert "no report from b; allowance on a: 10.0 s (stacks: " in st.reason, st.reason


def test_unreadable_hang_report_is_ignored():
    a = ns("a", "running", step=9, hang={"culprits": "x"})
    assert decide(NOW, view(status=status(RUNNING), node_status=[a])).actions == []


def test_a_job_its_ranks_refuse_fails_at_once_with_their_reason():
    why = "checkpoint dir /c belongs to job J0 and holds checkpoints of steps 10"
    v = view(status=status(RUNNING), node_status=[
        ns("a", "failed", exit_codes={"0": 78}, failed_rank=0, fault_at=NOW, refused=why),
        ns("b", "failed", exit_codes={"0": 78}, failed_rank=1, fault_at=NOW)])
    d = decide(NOW, v)
    st = only(d.actions, SetStatus).status
    assert st.state == "FAILED" and why in st.reason      # no restart: it would refuse again
    assert kinds(d.actions) == ["SetStatus", "Emit:failed"]


def _restore_failed(findings: dict, *, fault_at: float = NOW):
    """A view of round 2 failing to restore /c/10: `findings` node -> (kind, reason) or None
    (failed with no report)."""
    ck = [CheckpointRecord(step=5, path="/c/5", round=1, job_id="J"),
          CheckpointRecord(step=10, path="/c/10", round=1, job_id="J")]
    st = status(RENDEZVOUS, round=2, restore="/c/10", restore_step=10)
    statuses = [ns(n, "failed", round=2, exit_codes={"0": 76}, failed_rank=i, fault_at=fault_at,
                   restore_failed={"checkpoint": "/c/10", "kind": f[0], "reason": f[1]}
                   if f else {})
                for i, (n, f) in enumerate(findings.items())]
    return view(status=st, ckpts=ck, node_status=statuses), ck


SHARD = "__1_0.distcp fails its sha256 checksum (checkpoint /c/10 is corrupt)"
ABSENT = "checkpoint root /c holds no checkpoints on this node (no .lazarus-job, no step-*)"


def test_a_corrupt_checkpoint_is_marked_bad_named_and_an_older_one_used():
    from lazarus.daemon.actions import MarkCheckpoint
    v, ck = _restore_failed({"a": ("", SHARD), "b": ("corrupt", SHARD)})
    d = decide(NOW, v)
    (mark,) = [a for a in d.actions if isinstance(a, MarkCheckpoint)]
    assert mark.checkpoint.step == 10 and mark.good is False
    event = only(d.actions, Emit)
    assert event.kind == "fault_detected" and event.fields["kind"] == "bad_checkpoint"
    assert "__1_0.distcp fails its sha256 checksum" in event.message
    assert event.fields["why"] == SHARD
    st2 = only(d.actions, SetStatus).status
    ck[1] = dataclasses.replace(ck[1], good=False)
    rec = only(decide(NOW, view(status=st2, ckpts=ck)).actions, StartRound).record
    assert rec.restore_step == 5


def test_a_node_that_alone_cannot_read_the_checkpoint_is_cordoned_and_the_checkpoint_kept():
    from lazarus.daemon.actions import Cordon, MarkCheckpoint
    v, _ = _restore_failed({"a": ("", ABSENT), "b": ("unreadable", ABSENT)})
    d = decide(NOW, v)
    assert not [a for a in d.actions if isinstance(a, MarkCheckpoint)]
    assert only(d.actions, Cordon) == Cordon("b", ABSENT)
    event = only(d.actions, Emit)
    assert event.fields["kind"] == "checkpoint_unreadable" and event.fields["culprit"] == "b"
    assert ABSENT in event.message and "kept" in event.message
    # The next round restores the same checkpoint, without b.
    st2 = only(d.actions, SetStatus).status
    rec = only(decide(NOW, view(status=st2, ckpts=v.checkpoints, cordoned={"b"})).actions,
               StartRound).record
    assert rec.restore_step == 10 and rec.members == ["a"]


@pytest.mark.parametrize("findings, verdict", [
    # missing on one node only: that node's view (a file its cache or mount does not show)
    ({"a": ("missing", "__0_0.distcp is missing"), "b": ("", "x")}, "cordon a"),
    # missing for every node, in a root that holds the job's other checkpoints: gone
    ({"a": ("missing", "checkpoint /c/10 does not exist"),
      "b": ("missing", "checkpoint /c/10 does not exist")}, "condemn"),
    # corrupt wins over a node that cannot read
    ({"a": ("unreadable", ABSENT), "b": ("corrupt", SHARD)}, "condemn"),
    # no node can read the storage: nothing against this checkpoint more than older ones
    ({"a": ("unreadable", ABSENT), "b": ("unreadable", ABSENT)}, "keep"),
    ({"a": ("unreadable", "permission denied"), "b": ("missing", "gone")}, "keep"),
])
def test_restore_findings_decide_between_checkpoint_and_node(findings, verdict):
    from lazarus.daemon.actions import Cordon, MarkCheckpoint
    d = decide(NOW, _restore_failed(findings)[0])
    marked = [a for a in d.actions if isinstance(a, MarkCheckpoint)]
    cordoned = [a.node for a in d.actions if isinstance(a, Cordon)]
    got = ("condemn" if marked else f"cordon {' '.join(cordoned)}" if cordoned else "keep")
    assert got == verdict, d.reason
    assert only(d.actions, SetStatus).status.state == RECOVERING


def test_a_restore_failure_waits_for_every_nodes_finding_then_falls_back_to_the_old_rule():
    from lazarus.daemon.actions import MarkCheckpoint
    v, _ = _restore_failed({"a": ("unreadable", ABSENT), "b": None})
    d = decide(NOW, v)
    assert d.actions == [] and "waiting for what b found" in d.reason
    # b never says (a worker from before findings): a alone cannot tell, so the storage
    # is not blamed on the checkpoint ...
    late = NOW + settings.LEASE_TTL_S + 2
    assert not [a for a in decide(late, v).actions if isinstance(a, MarkCheckpoint)]
    # ... and nobody saying anything condemns it, as before findings existed.
    v, _ = _restore_failed({"a": None, "b": None})
    assert [a for a in decide(late, v).actions if isinstance(a, MarkCheckpoint)]


def test_a_frozen_rank_is_acted_on_at_once_and_named_alone():
    # b's rank is stopped inside a save: b's agent says so; a's rank waits for it. Neither
    # b's checkpoint phase nor a missing report holds the decision.
    a = ns("a", "running", step=21, hang=_hang_report(NOW - 1, {0: (21, "checkpoint", 114)}))
    frozen = {**_hang_report(NOW, {1: (21, "checkpoint", 114)}),
              "frozen": {"1": "stopped (SIGSTOP or a debugger)"}}
    b = ns("b", "running", step=21, hang=frozen,
           long_phase={"since": NOW - 20, "until": 0.0, "allowance_s": 600.0})
    d = decide(NOW, view(status=status(RUNNING), node_status=[a, b]))
    incident = only(d.actions, SetStatus).status.incident
    assert (incident["kind"], incident["culprit"]) == ("hang", "b"), d.reason
    assert "rank 1 is frozen" in d.reason


def test_hang_report_is_held_while_a_silent_peer_is_checkpointing():
    # n0's rank waits in forward for n1's rank, which is still saving a checkpoint (slow
    # storage): no hang, however long n0's allowance was.
    a = ns("a", "running", step=21, hang=_hang_report(NOW - 5, {0: (21, "forward", 114)}))
    b = ns("b", "running", step=20, long_phase={"since": NOW - 20, "until": NOW - 60})
    d = decide(NOW, view(status=status(RUNNING), node_status=[a, b]))
    assert d.actions == [] and "b is in a checkpoint or an eval" in d.reason
    # b's save ended 1 s ago: a's agent gets a moment to withdraw its report ...
    b = ns("b", "running", step=20, long_phase={"since": 0.0, "until": NOW - 1})
    d = decide(NOW, view(status=status(RUNNING), node_status=[a, b]))
    assert d.actions == [] and "just left a checkpoint" in d.reason
    # ... and a report still standing after that is a hang.
    d = decide(NOW + 5, view(status=status(RUNNING), node_status=[a, b]))
    assert only(d.actions, SetStatus).status.incident["kind"] == "hang"
    # A checkpoint that ended before the stall began explains nothing.
    b = ns("b", "running", step=20, long_phase={"since": 0.0, "until": NOW - 30})
    d = decide(NOW, view(status=status(RUNNING), node_status=[a, b]))
    assert only(d.actions, SetStatus).status.incident["kind"] == "hang"

    # A peer in a save past the allowance its agent gives it holds nothing: that agent
    # reports its own rank then (the allowance adapts to the saves seen; 600 s at most).
    b = ns("b", "running", step=20, long_phase={"since": NOW - 20, "until": 0.0,
                                                "allowance_s": 12.0})
    d = decide(NOW, view(status=status(RUNNING), node_status=[a, b]))
    assert only(d.actions, SetStatus).status.incident["kind"] == "hang"
    b = ns("b", "running", step=20, long_phase={"since": NOW - 20, "until": 0.0,
                                                "allowance_s": 30.0})
    assert decide(NOW, view(status=status(RUNNING), node_status=[a, b])).actions == []

    # Garbage in a silent peer's record holds nothing.
    for junk in ({"since": True}, {"since": 1e308}, {"since": "x", "until": [1]}):
        b = ns("b", "running", step=20, long_phase=junk)
        d = decide(NOW, view(status=status(RUNNING), node_status=[a, b]))
        assert only(d.actions, SetStatus).status.incident["kind"] == "hang", junk


# -- a job of the user's own command (docs/adopting.md) -----------------------------------------

def _crash_in_rendezvous(st, code=1, tail="ValueError: --lr must be positive"):
    v = view(status=st, node_status=[ns("a", "starting", round=st.round),
                                     ns("b", "failed", round=st.round, failed_rank=2,
                                        exit_codes={"0": code}, fault_at=NOW - 0.1,
                                        output_tail=f"Traceback ...\n{tail}")])
    return decide(NOW, v)


@pytest.mark.parametrize("before, how, code, expect", [
    (0, "", 1, 1),      # the first
    (1, "1", 1, 2),     # again the same way
    (2, "2", 1, 1),     # another way: counting starts again
    (2, "1", -9, 1),    # killed by a signal is another way
])
def test_rounds_that_crash_before_they_run_are_counted(before, how, code, expect):
    d = _crash_in_rendezvous(status(RENDEZVOUS, early_failures=before, early_failure=how),
                             code=code)
    st = only(d.actions, SetStatus).status
    assert st.state == RECOVERING and st.early_failures == expect
    if code > 0:  # what the rank printed last, in the fault's words
        assert d.reason.endswith("last output: Traceback ... | ValueError: --lr must be positive")
    else:         # a signal leaves nothing the rank could have said about it
        assert "last output" not in d.reason
    assert only(d.actions, Emit).fields["output_tail"].endswith("must be positive")


def test_a_crash_of_a_running_round_is_not_an_early_failure():
    d = _crash_in_rendezvous(status(RUNNING, early_failures=2, early_failure="1"))
    assert only(d.actions, SetStatus).status.early_failures == 2


def test_three_rounds_that_crash_the_same_way_before_they_run_fail_the_run():
    st = status(RECOVERING, early_failures=3, early_failure="1", reason="worker crash on b ...; "
                "last output: ValueError: --lr must be positive", restarts=2)
    d = decide(NOW, view(status=st, j=job(max_restarts=20)))
    failed = only(d.actions, SetStatus).status
    assert failed.state == FAILED
    assert failed.reason.startswith("every one of the last 3 rounds crashed before it ran "
                                    "(exit 1): the job cannot start")
    assert "--lr must be positive" in failed.reason
    # two such rounds are not enough: the third is started
    st = dataclasses.replace(st, early_failures=2)
    assert kinds(decide(NOW, view(status=st, j=job(max_restarts=20))).actions)[0] == "StartRound"


def test_a_round_that_runs_clears_the_count():
    st = status(RENDEZVOUS, early_failures=2, early_failure="1")
    v = view(status=st, node_status=[ns("a", "running"), ns("b", "running")])
    assert only(decide(NOW, v).actions, SetStatus).status.early_failures == 0


def test_a_script_that_reports_no_steps_has_recovered_once_its_ranks_joined():
    inc = {"kind": "worker_crash", "culprit": "b", "fault_at": NOW - 3, "detected_at": NOW - 2.9,
           "round": 1}
    st = status(RUNNING, round=2, incident=inc)
    v = view(status=st, node_status=[ns("a", "running", round=2), ns("b", "running", round=2)])
    d = decide(NOW, v)
    assert only(d.actions, Emit).message == ("recovered from worker_crash (b): every rank joined "
                                             "its process group 3.0 s after the fault")


def test_a_round_carries_the_jobs_command():
    j = jobspec.from_dict({"job": {"name": "own", "nodes": 2, "min_nodes": 1, "id": "J",
                                   "nproc_per_node": 2, "max_restarts": 7,
                                   "command": ["python", "train.py", "--lr", "3e-4"],
                                   "env": {"HF_HOME": "/data"}, "cwd": "/home/me"}}, source="t")
    st = status(RECOVERING, restarts=2)
    rec = only(decide(NOW, view(status=st, j=j)).actions, StartRound).record
    assert (rec.command, rec.env, rec.cwd) == (["python", "train.py", "--lr", "3e-4"],
                                               {"HF_HOME": "/data"}, "/home/me")
    assert (rec.restarts, rec.max_restarts) == (3, 7)


def test_without_spares_ok_the_first_round_keeps_the_spares_for_faults():
    j = job(start_on_spares=False)
    st = RunStatus(job_id="J", state=PENDING, since=NOW - 1)
    d = decide(NOW, view(status=st, nodes=("a",), spares=("s",), j=j, submitted=j))
    assert d.actions == [] and d.reason.endswith(
        "spares are kept for faults (--spares-ok starts on them)")
    # past the rendezvous timeout it starts on what active nodes there are, min_nodes allowing
    st = dataclasses.replace(st, since=NOW - 31)
    rec = only(decide(NOW, view(status=st, nodes=("a",), spares=("s",), j=j,
                                submitted=j)).actions, StartRound).record
    assert rec.members == ["a"]


# What an agent says of a rank SIGKILL could not end (lazarus.agent.workers.Workers.set_aside).
STUCK_WHY = ("stuck in the kernel (wchan folio_wait_bit_common, opening /mnt/nfs/shard-3.bin); "
             "SIGKILL cannot end it")
STUCK_SAID = f"rank 1 (pid 4242) {STUCK_WHY}"
STUCK_CORDON = f"{STUCK_SAID}; reboot the node, then `lazarus uncordon b`"


def _stuck(name="b", *, round=2, **kw) -> NodeStatus:
    return ns(name, "starting", round=round,
              unkillable=[{"pid": 4242, "rank": 1, "why": STUCK_WHY}], **kw)


@pytest.mark.parametrize("state", [RENDEZVOUS, RUNNING])
def test_a_member_holding_a_rank_sigkill_cannot_end_is_cordoned_and_replaced(state):
    """The new round's agent on b killed the last round's ranks and one stayed, in the kernel:
    b is cordoned with that reason and the run recovers, in one event; the next round takes
    the spare in its place."""
    from lazarus.daemon.actions import Cordon
    v = view(status=status(state, round=2), spares=("s",),
             node_status=[ns("a", "starting", round=2), _stuck()])
    d = decide(NOW, v)
    assert kinds(d.actions) == ["Cordon", "SetStatus", "Emit:fault_detected"]
    assert d.actions[0] == Cordon("b", reason=STUCK_CORDON)
    st = d.actions[1].status
    assert st.state == RECOVERING and st.incident["kind"] == "unkillable_rank"
    assert st.incident["culprit"] == "b"
    event = d.actions[2]
    assert event.message == (f"b cannot serve: {STUCK_SAID}; cordoned (reboot the node, then "
                             "`lazarus uncordon b`), replaced") == st.reason
    assert event.fields["processes"] == {"b": [{"pid": 4242, "rank": 1, "why": STUCK_WHY}]}
    # the next pass: the spare takes b's place
    rec = only(decide(NOW, view(status=st, spares=("s",), cordoned=("b",))).actions,
               StartRound).record
    assert rec.members == ["a", "s"]


def test_with_no_spare_the_run_shrinks_without_the_stuck_node():
    v = view(status=status(RUNNING, round=2), node_status=[ns("a", "running", round=2,
                                                               step=3), _stuck()])
    st = only(decide(NOW, v).actions, SetStatus).status
    rec = only(decide(NOW, view(status=st, cordoned=("b",))).actions, StartRound).record
    assert rec.members == ["a"] and rec.train["data"]["global_batch"] == 8


def test_a_member_already_cordoned_is_replaced_without_a_second_cordon():
    v = view(status=status(RUNNING, round=2), spares=("s",), cordoned=("b",),
             node_status=[ns("a", "running", round=2, step=3), _stuck()])
    assert kinds(decide(NOW, v).actions) == ["SetStatus", "Emit:fault_detected"]


@pytest.mark.parametrize("st", [
    None,                                                      # no run
    status(SUCCEEDED, members=("a", "b")),                     # the run is over
    status(RUNNING, members=("a",)),                           # b is no member
    status(PENDING, members=()),
])
def test_any_other_node_holding_one_is_cordoned_with_one_event(st):
    from lazarus.daemon.actions import Cordon
    v = view(status=st, nodes=("a", "b"), node_status=[_stuck()])
    if st is not None and st.state == RUNNING:
        v.node_status["a"] = ns("a", "running", round=2, step=3)
        v.status = dataclasses.replace(st, round=2)
    d = decide(NOW, v)
    assert d.actions[:2] == [
        Cordon("b", reason=STUCK_CORDON),
        Emit("unkillable_rank", f"b cannot serve: {STUCK_SAID}; cordoned (reboot the node, "
                                "then `lazarus uncordon b`)",
             {"node": "b", "culprit": "b",
              "processes": [{"pid": 4242, "rank": 1, "why": STUCK_WHY}]})]
    assert not [a for a in d.actions[2:] if isinstance(a, Cordon)]
    # cordoned, it is left alone: no second event on the next pass
    v.cordoned = {"b"}
    assert not [a for a in decide(NOW, v).actions if isinstance(a, Emit)
                and a.kind == "unkillable_rank"]


def test_a_recovery_that_meets_one_chooses_the_round_without_it():
    """Cordoned in the same pass that starts the next round: that round does not take it."""
    st = dataclasses.replace(status(RUNNING, round=2), state=RECOVERING)
    v = view(status=st, spares=("s",), node_status=[_stuck()])
    d = decide(NOW, v)
    assert kinds(d.actions)[:2] == ["Cordon", "Emit:unkillable_rank"]
    assert only(d.actions, StartRound).record.members == ["a", "s"]


def test_the_cordon_stays_when_the_process_ends_and_an_operator_lifts_it():
    """Only an operator's uncordon lifts it (after a reboot): the leader never does."""
    v = view(status=status(RUNNING, round=2), cordoned=("b",), spares=("s",),
             node_status=[ns("a", "running", round=2, step=3)])
    v.cordon_reason = {"b": STUCK_CORDON}
    assert decide(NOW, v).actions == []


@pytest.mark.parametrize("entries", [
    [{"pid": "4242", "rank": 1, "why": "x"}],     # a pid that is no number
    [{"pid": 4242, "rank": True, "why": "x"}],    # nor a rank
    [{"pid": -1, "rank": 1}],
    [{}],
])
def test_garbage_unkillable_entries_are_no_evidence(entries):
    v = view(status=status(RUNNING, round=2),
             node_status=[ns("a", "running", round=2, step=3),
                          ns("b", "running", round=2, step=3, unkillable=entries)])
    assert decide(NOW, v).actions == []


def test_a_long_reason_is_clipped_but_keeps_the_advice():
    from lazarus.daemon.actions import Cordon
    from lazarus.daemon.view import MAX_CORDON_REASON
    many = [{"pid": 4242 + i, "rank": i, "why": "stuck in the kernel (" + "x" * 500 + ")"}
            for i in range(50)]
    v = view(status=None, node_status=[ns("b", "idle", unkillable=many)])
    d = decide(NOW, v)
    reason = only(d.actions, Cordon).reason
    assert len(reason) <= MAX_CORDON_REASON
    assert reason.startswith("rank 0 (pid 4242) stuck in the kernel (xxx")
    assert reason.endswith("...; 7 more; reboot the node, then `lazarus uncordon b`")
    event = next(a for a in d.actions if isinstance(a, Emit) and a.kind == "unkillable_rank")
    assert len(event.fields["processes"]) == 8
