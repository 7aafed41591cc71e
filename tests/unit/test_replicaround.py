"""Replica rounds (daemon/replicaround.py, docs/replicas.md): a fault inside one replica of a
replica job restarts only that replica, in the same pass, and everything that cannot be
answered that way stays the whole-world recovery. Table tests of decide()."""

from __future__ import annotations

import dataclasses

import pytest

from lazarus.core import exitcodes
from lazarus.core.records import (RECOVERING, RENDEZVOUS, RUNNING, PENDING, RoundRecord,
                                  RunStatus)
from lazarus.daemon.actions import Cordon, Emit, SetStatus, StartRound
from lazarus.daemon.decide import decide
from tests.unit.test_decide import NOW, job, kinds, ns, only, status, view

NODES = ("a", "b", "c", "d")  # replica 0: a, b; replica 1: c, d (2 ranks each)


def rjob(**kw):
    return job(nodes=4, min_nodes=4, failure_unit="replica", replicas=2, **kw)


def first_round(spares=("s",)) -> RoundRecord:
    d = decide(NOW, view(status=RunStatus(job_id="J", state=PENDING, since=NOW - 1),
                         nodes=NODES, spares=spares, j=rjob()))
    return only(d.actions, StartRound).record


def live(rec: RoundRecord, state=RUNNING, *, node_status=(), nodes=NODES, spares=("s",),
         restarts=0, **kw):
    """A view of `rec` live: status `state` of its round, its record as view.round."""
    st = status(state, round=rec.round, members=rec.members, restarts=restarts, **kw)
    v = view(status=st, nodes=nodes, spares=spares, node_status=node_status, j=rjob())
    v.round = v.latest_round = rec
    return v


def running(*, round=1, step=12, skip=(), **failed):
    """Statuses of every member at `round`: running at `step`, but those in `failed`
    (node -> exit codes) failed."""
    out = []
    for n in NODES:
        if n in skip:
            continue
        if n in failed:
            out.append(ns(n, "failed", round=round, step=step, failed_rank=0,
                          exit_codes=failed[n], fault_at=NOW - 0.2))
        else:
            out.append(ns(n, "running", round=round, step=step))
    return out


def emitted(d, kind):
    return [a for a in d.actions if isinstance(a, Emit) and a.kind == kind]


def readable(rec: RoundRecord, st: RunStatus):
    """What the executor writes, read back as an agent reads it (the records' checks)."""
    assert RoundRecord.from_json(rec.to_json()) == rec
    assert RunStatus.from_json(st.to_json()) == st


def test_a_replica_job_s_round_starts_every_replica_with_dp_for_one():
    rec = first_round()
    assert rec.members == ["a", "b", "c", "d"] and rec.world_size == 8
    assert (rec.replicas, rec.replica_rounds, rec.replica_epoch) == (2, [1, 1], 1)
    assert rec.dp == 4 and rec.train["parallelism"]["dp"] == 4  # 2 nodes x 2 ranks
    assert (rec.replica_members(0), rec.replica_members(1)) == (["a", "b"], ["c", "d"])
    assert RoundRecord.from_json(rec.to_json()) == rec


def test_a_worker_crash_in_one_replica_restarts_only_it_in_the_same_pass():
    rec = first_round()
    # c's rank crashed; d's, of the same replica, lost their peer; replica 0 trains on
    v = live(rec, node_status=running(c={"0": -9}, d={"2": exitcodes.PEER_LOST}))
    d = decide(NOW, v)
    assert kinds(d.actions) == ["Emit:fault_detected", "StartRound", "SetStatus",
                                "Emit:replica_left", "Emit:replica_healing",
                                "Emit:round_started"]
    new = only(d.actions, StartRound).record
    assert new.round == 2 and new.members == rec.members
    assert (new.replica_rounds, new.replica_epoch) == ([1, 2], 1)
    assert new.carried(0) and not new.carried(1)
    assert (new.store_host, new.store_port) == (rec.store_host, rec.store_port)
    assert (new.restore, new.restore_step, new.tier0, new.train) == (None, 0, None, rec.train)
    st = only(d.actions, SetStatus).status
    assert (st.state, st.round, st.restarts, st.members) == (RENDEZVOUS, 2, 1, rec.members)
    assert st.incident["kind"] == "worker_crash" and st.incident["replicas"] == [1]
    assert st.incident["culprit"] == "c" and st.incident["round"] == 1
    left, = emitted(d, "replica_left")
    assert left.fields == {"replica": 1, "nodes": ["c", "d"], "reason": "worker_crash"}
    healing, = emitted(d, "replica_healing")
    assert healing.fields == {"replica": 1, "spares": [], "sources": [0]}
    started, = emitted(d, "round_started")
    assert started.fields["replicas"] == [1] and started.fields["restore_step"] == 0
    assert "replica(s) 1 anew" in started.message
    readable(new, st)


def test_a_lost_node_of_a_replica_is_replaced_by_a_spare_at_its_index():
    rec = first_round()
    # c is gone (its lease ran out); d's ranks lost their peer
    v = live(rec, nodes=("a", "b", "d"), node_status=running(skip="c", d={"2": 75}))
    d = decide(NOW, v)
    new = only(d.actions, StartRound).record
    assert new.members == ["a", "b", "s", "d"] and new.replica_rounds == [1, 2]
    assert new.replica_members(1) == ["s", "d"]
    st = only(d.actions, SetStatus).status
    assert st.state == RENDEZVOUS and st.members == ["a", "b", "s", "d"]
    assert st.incident["kind"] == "node_lost"
    assert emitted(d, "replica_left")[0].fields["nodes"] == ["c", "d"]
    assert emitted(d, "replica_healing")[0].fields == {"replica": 1, "spares": ["s"],
                                                       "sources": [0]}
    readable(new, st)


def test_a_failed_gpu_in_a_replica_is_cordoned_and_replaced_by_a_spare():
    rec = first_round()
    sick = {"gpu": {"state": "failed", "reasons": ["Xid 79"]}}
    statuses = running()
    statuses[3] = ns("d", "running", step=12, health=sick)
    d = decide(NOW, live(rec, node_status=statuses))
    assert only(d.actions, Cordon).node == "d"
    new = only(d.actions, StartRound).record
    assert new.members == ["a", "b", "c", "s"] and new.replica_rounds == [1, 2]


def test_a_lost_node_without_a_spare_recovers_the_whole_world_as_today():
    rec = first_round(spares=())
    v = live(rec, nodes=("a", "b", "d"), spares=(), node_status=running(skip="c"))
    d = decide(NOW, v)
    assert kinds(d.actions) == ["SetStatus", "Emit:fault_detected"]
    assert only(d.actions, SetStatus).status.state == RECOVERING


@pytest.mark.parametrize("failed, why", [
    ({"a": {"0": -9}, "b": {"2": 75}}, "the first member hosts every replica's store"),
    ({"b": {"2": -9}, "c": {"4": -9}}, "no replica left to heal from"),
    ({"c": {"4": -9}, "a": {"0": 75}}, "replica 0's ranks exited too"),
])
def test_what_a_replica_round_cannot_answer_stays_a_whole_world_recovery(failed, why):
    rec = first_round()
    d = decide(NOW, live(rec, node_status=running(**failed)))
    assert kinds(d.actions) == ["SetStatus", "Emit:fault_detected"], why
    assert only(d.actions, SetStatus).status.state == RECOVERING


def test_the_whole_world_round_after_a_replica_round_starts_a_new_epoch():
    rec = first_round()
    replica_round = dataclasses.replace(rec, round=3, replica_rounds=[1, 3])
    v = live(replica_round, node_status=running(round=3, b={"0": -9}, c={"4": -9}))
    d = decide(NOW, v)
    st = only(d.actions, SetStatus).status
    assert st.state == RECOVERING
    v2 = live(replica_round, RECOVERING, node_status=v.node_status.values(),
              incident=st.incident)
    v2.status = st
    new = only(decide(NOW + 0.1, v2).actions, StartRound).record
    assert new.round == 4 and (new.replica_rounds, new.replica_epoch) == ([4, 4], 4)
    assert new.members == rec.members and new.dp == 4


def test_recovered_waits_for_the_restarted_replica_and_says_it_joined():
    rec = first_round()
    d = decide(NOW, live(rec, node_status=running(c={"0": -9})))
    st = only(d.actions, SetStatus).status
    new = only(d.actions, StartRound).record
    st = dataclasses.replace(st, state=RUNNING)
    # the carried replica reports the new round at once, steps on; the restarted one has
    # joined its world and not healed yet
    carried = [ns(n, "running", round=2, step=40, in_place=[0, 1]) for n in ("a", "b")]
    fresh = [ns("c", "running", round=2, step=0, anew={"failed first": [4]}),
             ns("d", "running", round=2, step=0, anew={"peer failed": [6]})]
    v = live(new, node_status=[*carried, *fresh])
    v.status = st
    d = decide(NOW + 1, v)
    assert emitted(d, "recovered") == [] and emitted(d, "replica_joined") == []
    fresh[0] = ns("c", "running", round=2, step=41, updated_at=NOW + 1.5,
                  anew={"failed first": [4]})
    v = live(new, node_status=[*carried, *fresh])
    v.status = st
    d = decide(NOW + 2, v)
    back, = emitted(d, "recovered")
    assert back.fields["first_step"] == 41 and back.fields["replicas"] == [1]
    assert back.fields["in_place_ranks"] == 0  # replica 0's ranks say nothing of replica 1
    assert back.fields["anew"] == {"failed first": 1, "peer failed": 1}
    joined, = emitted(d, "replica_joined")
    assert joined.fields == {"replica": 1, "step": 41}
    assert only(d.actions, SetStatus).status.incident is None


def test_a_replica_that_crashes_again_before_it_runs_gets_another_replica_round():
    rec = first_round()
    d = decide(NOW, live(rec, node_status=running(c={"0": 1})))
    new = only(d.actions, StartRound).record
    st = only(d.actions, SetStatus).status
    # round 2: a, b carried (relabelled), c's rank exits 1 again at its start
    statuses = [*(ns(n, "running", round=2, step=14) for n in ("a", "b")),
                ns("c", "failed", round=2, failed_rank=4, exit_codes={"4": 1}, fault_at=NOW),
                ns("d", "starting", round=2)]
    v = live(new, RENDEZVOUS, node_status=statuses, restarts=1)
    v.status = st
    d = decide(NOW + 1, v)
    third = only(d.actions, StartRound).record
    assert third.round == 3 and third.replica_rounds == [1, 3] and third.replica_epoch == 1
    st = only(d.actions, SetStatus).status
    assert (st.state, st.restarts, st.early_failures) == (RENDEZVOUS, 2, 1)


def test_a_replica_round_counts_against_max_restarts():
    rec = first_round()
    v = live(rec, node_status=running(c={"0": -9}), restarts=3)  # job(): max_restarts 3
    d = decide(NOW, v)
    assert only(d.actions, SetStatus).status.state == RECOVERING
    assert not [a for a in d.actions if isinstance(a, StartRound)]


def test_a_world_job_is_unchanged():
    d = decide(NOW, view(status=status(RUNNING),
                         node_status=[ns("a", "running", step=12),
                                      ns("b", "failed", failed_rank=3, exit_codes={"1": -9})]))
    assert kinds(d.actions) == ["SetStatus", "Emit:fault_detected"]
    st = RunStatus(job_id="J", state=PENDING, since=NOW - 1)
    rec = only(decide(NOW, view(status=st)).actions, StartRound).record
    assert (rec.replicas, rec.replica_rounds, rec.replica_epoch) == (1, [], 0)


def test_a_cordoned_node_of_the_broken_replica_is_replaced_too():
    rec = first_round(spares=("s", "t"))
    v = live(rec, spares=("s", "t"), node_status=running(c={"0": -9}))
    v.cordoned = {"d"}  # an operator's, while the round ran
    new = only(decide(NOW, v).actions, StartRound).record
    assert new.members == ["a", "b", "c", "s"] and new.replica_rounds == [1, 2]
    v.cordoned = {"b"}  # in the carried replica: its ranks go on where they are
    new = only(decide(NOW, v).actions, StartRound).record
    assert new.members == ["a", "b", "c", "d"]


def test_a_fault_while_the_other_replica_still_heals_starts_the_world_anew():
    rec = first_round()
    d = decide(NOW, live(rec, node_status=running(c={"0": -9})))
    new, st = only(d.actions, StartRound).record, only(d.actions, SetStatus).status
    # round 2 runs; replica 1 has not stepped yet (no state) when replica 0's b crashes
    statuses = [ns("a", "running", round=2, step=14),
                ns("b", "failed", round=2, step=14, failed_rank=2, exit_codes={"2": -9}),
                *(ns(n, "running", round=2, step=0) for n in ("c", "d"))]
    v = live(new, node_status=statuses, restarts=1)
    v.status = dataclasses.replace(st, state=RUNNING)
    d = decide(NOW + 1, v)
    assert kinds(d.actions) == ["SetStatus", "Emit:fault_detected"]
    assert only(d.actions, SetStatus).status.state == RECOVERING
    # once replica 1 stepped (recovered), the same fault restarts replica 0 alone
    v.status = dataclasses.replace(v.status, incident=None)
    new3 = only(decide(NOW + 1, v).actions, StartRound).record
    assert new3.replica_rounds == [3, 2] and new3.replica_epoch == 1


def test_the_run_ends_when_the_live_replicas_finish_while_another_still_heals():
    """Replica 0 finishes its steps while replica 1 restarts: nobody is left to heal it from,
    and the model is replica 0's: the run succeeded, replica 1's ranks are stopped."""
    rec = first_round()
    d = decide(NOW, live(rec, node_status=running(c={"0": -9})))
    st = only(d.actions, SetStatus).status
    new = only(d.actions, StartRound).record
    done = [ns(n, "succeeded", round=2, step=60) for n in ("a", "b")]
    healing = [ns(n, "starting", round=2, step=0) for n in ("c", "d")]
    v = live(new, state=RENDEZVOUS, node_status=[*done, healing[0]])
    v.status = st
    d = decide(NOW + 1, v)
    end = only(d.actions, SetStatus).status
    assert end.state == "SUCCEEDED" and end.incident is None
    assert "all steps done by replica(s) 0" in end.reason and "replica(s) 1 were still healing" \
        in end.reason, end.reason
    # one replica of the two still training: nothing ends
    v = live(new, state=RENDEZVOUS, node_status=[done[0], ns("b", "running", round=2, step=59),
                                                 *healing])
    v.status = st
    assert not any(isinstance(a, SetStatus) and a.status.state == "SUCCEEDED"
                   for a in decide(NOW + 1, v).actions)


def test_a_drain_moves_only_its_replica_onto_a_spare_with_no_checkpoint():
    # the operator's drain, a degrading GPU's, a straggler's swap: all are drains
    rec = first_round()
    v = live(rec, node_status=running())
    v.drains = {"c": 9}
    d = decide(NOW, v)
    new = only(d.actions, StartRound).record
    assert new.members == ["a", "b", "s", "d"] and new.replica_rounds == [1, 2]
    assert new.restarts == 0  # a planned move is no failure: no restart counted
    assert [a.node for a in d.actions if isinstance(a, Cordon)] == ["c"]
    assert "RequestCheckpoint" not in kinds(d.actions)
    st = only(d.actions, SetStatus).status
    assert st.state == RENDEZVOUS and st.incident["replicas"] == [1]
    assert st.incident["kind"] == "drain" and st.incident["culprit"] == "c"
    assert emitted(d, "replica_left")[0].fields == {"replica": 1, "nodes": ["c", "d"],
                                                    "reason": "drain"}
    assert "replica move" in d.reason and "s in place of c" in d.reason
    readable(new, st)


@pytest.mark.parametrize("drained, spares", [(["a"], ("s",)), (["c"], ()),
                                             (["a", "c"], ("s", "t"))])
def test_a_drain_a_replica_round_cannot_make_waits_for_a_checkpoint(drained, spares):
    # the first member's agent hosts the quorum's store; without a spare a replica cannot
    # move; with both replicas drained there is nobody to heal from
    rec = first_round(spares)
    v = live(rec, node_status=running(), spares=spares)
    v.drains = {n: 9 for n in drained}
    d = decide(NOW, v)
    assert kinds(d.actions) == ["RequestCheckpoint"], d


def test_a_drain_waits_while_a_replica_still_heals():
    rec = first_round(("s", "t"))
    # replica 1 restarted, not stepped yet
    v = live(rec, node_status=running(skip=("c", "d")) + [ns(n, "running", step=0)
                                                          for n in ("c", "d")],
             spares=("s", "t"),
             incident={"kind": "worker_crash", "culprit": "c", "fault_at": NOW - 5,
                       "detected_at": NOW - 5, "round": 1, "replicas": [1]})
    v.drains = {"b": 9}
    d = decide(NOW, v)
    assert d.actions == [] and "healing" in d.reason
