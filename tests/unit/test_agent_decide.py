"""Table-driven tests of the agent's policy (lazarus.agent.decide): one row per situation, the
exact actions a pass takes."""

from __future__ import annotations

import pytest

from lazarus.agent.decide import (RELEASE_S, CarryOn, DropKept, Launch, Local, Refill,
                                  ReleaseVictims, ReportHang, SeeRound, StopRound, WithdrawHang,
                                  converge, cut_off, hang, status_due)
from lazarus.core.contract import HangVerdict
from lazarus.core.records import (CANCELLED, FAILED, PAUSED, PENDING, RECOVERING, RENDEZVOUS,
                                  RUNNING, SUCCEEDED, RoundRecord, RunStatus)

NODE = "a"


def status(state: str, round_: int = 2, members=("a", "b")) -> RunStatus:
    return RunStatus(job_id="J", state=state, round=round_, members=list(members), since=1.0)


def record(round_: int = 2, members=("a", "b")) -> RoundRecord:
    return RoundRecord(round=round_, job_id="J", members=list(members), nproc_per_node=2,
                       world_size=2 * len(members), dp=len(members), tp=1,
                       store_host="127.0.0.1", store_port=1)


R2, R3 = record(2), record(3)
R3_WITHOUT_US = record(3, members=("b", "c"))
NONE = Local()
ALIVE2, EXITED2 = Local(2, alive=True), Local(2, alive=False)
SURVIVED2 = Local(2, alive=True, survivors=frozenset({0}))  # local rank 0 lost a peer
KEPT = Local(kept=True)  # survivors of a stopped round wait for a launch
VICTIMS = Local(2, alive=True, waiting=True, over_s=1.0)  # ranks that waited on a hung peer


def hung(culprit: str, round_: int = 2, kind: str = "hang") -> RunStatus:
    return RunStatus(job_id="J", state=RECOVERING, round=2, members=["a", "b"], since=1.0,
                     incident={"kind": kind, "culprit": culprit, "fault_at": 1.0,
                               "detected_at": 1.0, "round": round_})

CONVERGE = {
    # situation: (status, round record, this node's ranks) -> actions
    "no run": (None, None, NONE, [Refill()]),
    "a run that has no round yet": (status(PENDING, 0), None, NONE, [Refill()]),
    "a new round for this node": (status(RENDEZVOUS), R2, NONE,
                                  [SeeRound(R2), Launch(R2), Refill()]),
    "its round running here": (status(RUNNING), R2, ALIVE2, [SeeRound(R2), Refill()]),
    "its round's ranks exited, the run goes on": (status(RUNNING), R2, EXITED2,
                                                  [SeeRound(R2), Refill()]),
    "a stale round's ranks still running": (
        status(RENDEZVOUS, 3), R3, ALIVE2,
        [StopRound(2, "round 3 is current"), SeeRound(R3), Launch(R3), Refill()]),
    "a stale round's ranks exited": (
        status(RENDEZVOUS, 3), R3, EXITED2,
        [StopRound(2, "round 3 is current"), SeeRound(R3), Launch(R3), Refill()]),
    "not a member of the round": (status(RENDEZVOUS, 3, ("b", "c")), R3_WITHOUT_US, NONE,
                                  [SeeRound(R3_WITHOUT_US), Refill()]),
    "left out of the next round while running": (
        status(RENDEZVOUS, 3, ("b", "c")), R3_WITHOUT_US, ALIVE2,
        [StopRound(2, "round 3 is current"), SeeRound(R3_WITHOUT_US), Refill()]),
    "the round record not read yet": (status(RENDEZVOUS, 3), None, ALIVE2,
                                      [StopRound(2, "round 3 is current"), Refill()]),
    "a round record of another round": (status(RENDEZVOUS, 3), R2, NONE, [Refill()]),
    "run finished, its ranks exited": (status(SUCCEEDED), R2, EXITED2,
                                       [SeeRound(R2), Refill()]),
    "run paused, its ranks still running": (status(PAUSED), R2, ALIVE2,
                                            [StopRound(2, "run is PAUSED"), SeeRound(R2),
                                             Refill()]),
    "run recovering, the old round still running": (
        status(RECOVERING), R2, ALIVE2, [StopRound(2, "run is RECOVERING"), SeeRound(R2),
                                         Refill()]),
    "run paused, nothing running here": (status(PAUSED), R2, NONE, [SeeRound(R2), Refill()]),
    "run gone, ranks still running": (None, None, ALIVE2,
                                      [StopRound(2, "run is gone"), Refill()]),
    "run gone, ranks exited": (None, None, EXITED2, [Refill()]),
    # in-place recovery (docs/inplace.md): survivors of a lost peer outlive their round
    "survivors while the run recovers: kept": (
        status(RECOVERING), R2, SURVIVED2,
        [StopRound(2, "run is RECOVERING", frozenset({0})), SeeRound(R2), Refill()]),
    "survivors when the next round is out: kept, then launched": (
        status(RENDEZVOUS, 3), R3, SURVIVED2,
        [StopRound(2, "round 3 is current", frozenset({0})), SeeRound(R3), Launch(R3),
         Refill()]),
    "survivors, the next round's record not read yet: kept": (
        status(RENDEZVOUS, 3), None, SURVIVED2,
        [StopRound(2, "round 3 is current", frozenset({0})), Refill()]),
    "survivors, the next round leaves this node out: let go": (
        status(RENDEZVOUS, 3, ("b", "c")), R3_WITHOUT_US, SURVIVED2,
        [StopRound(2, "round 3 is current"), SeeRound(R3_WITHOUT_US), Refill()]),
    "survivors of a run that failed: killed": (
        status(FAILED), R2, SURVIVED2, [StopRound(2, "run is FAILED"), SeeRound(R2), Refill()]),
    "survivors still in their round: left alone": (status(RUNNING), R2, SURVIVED2,
                                                   [SeeRound(R2), Refill()]),
    "kept survivors, the next round leaves this node out": (
        status(RENDEZVOUS, 3, ("b", "c")), R3_WITHOUT_US, KEPT,
        [DropKept("this node is not in the current round"), SeeRound(R3_WITHOUT_US),
         Refill()]),
    "kept survivors, the run ended": (status(CANCELLED, 3), R3, KEPT,
                                      [DropKept("run is CANCELLED"), SeeRound(R3), Refill()]),
    "kept survivors, the next round is out": (status(RENDEZVOUS, 3), R3, KEPT,
                                              [SeeRound(R3), Launch(R3), Refill()]),
    # a hang: the victims wait in a collective for the culprit's node to kill it
    "a hang on another node, victims not released yet: held": (
        hung("b"), R2, VICTIMS, [ReleaseVictims(2), Refill()]),
    "a hang on another node, victims released in part: still held": (
        hung("b"), R2, Local(2, alive=True, survivors=frozenset({0}), waiting=True),
        [ReleaseVictims(2), Refill()]),
    "a hang on another node, victims never released: killed": (
        hung("b"), R2, Local(2, alive=True, waiting=True, over_s=RELEASE_S),
        [StopRound(2, "run is RECOVERING"), SeeRound(R2), Refill()]),
    "a hang on this node: its ranks killed at once": (
        hung("a"), R2, VICTIMS, [StopRound(2, "run is RECOVERING"), SeeRound(R2), Refill()]),
    "a crash on another node, its peers here not aware yet: held": (
        hung("b", kind="worker_crash"), R2, VICTIMS, [ReleaseVictims(2), Refill()]),
    "a crash of a rank of this node, its other ranks not aware yet: held as well": (
        hung("a", kind="worker_crash"), R2, VICTIMS, [ReleaseVictims(2), Refill()]),
    "a crash of a rank of this node, its others never released: killed": (
        hung("a", kind="worker_crash"), R2, Local(2, alive=True, waiting=True, over_s=RELEASE_S),
        [StopRound(2, "run is RECOVERING"), SeeRound(R2), Refill()]),
    "a failed GPU on this node: its ranks killed at once": (
        hung("a", kind="gpu_failed"), R2, VICTIMS,
        [StopRound(2, "run is RECOVERING"), SeeRound(R2), Refill()]),
    "a node lost: its peers noticed long before, the rest are killed at once": (
        hung("b", kind="node_lost"), R2, VICTIMS,
        [StopRound(2, "run is RECOVERING"), SeeRound(R2), Refill()]),
    "a loss-spike rollback: healthy ranks are not victims, killed at once": (
        hung("data 1..8", kind="loss_spike"), R2, VICTIMS,
        [StopRound(2, "run is RECOVERING"), SeeRound(R2), Refill()]),
    "a hang of an earlier round: nothing held": (
        hung("b", round_=1), R2, VICTIMS,
        [StopRound(2, "run is RECOVERING"), SeeRound(R2), Refill()]),
}


@pytest.mark.parametrize("situation", list(CONVERGE))
def test_converge(situation):
    st, rec, local, expected = CONVERGE[situation]
    assert converge(NODE, st, rec, local) == expected


# Replica groups (docs/replicas.md): two replicas, (a, b) and (c, d), started whole in round 3.
# Round 5 restarts replica 1 after a fault of c's; replica 0's ranks go on from round 3.
FOUR = ("a", "b", "c", "d")


def replica_record(round_: int, replica_rounds: list[int]) -> RoundRecord:
    return RoundRecord(round=round_, job_id="J", members=list(FOUR), nproc_per_node=2,
                       world_size=8, dp=2, tp=1, store_host="127.0.0.1", store_port=1,
                       replicas=2, replica_rounds=replica_rounds, replica_epoch=3)


def replica_status(state: str = RENDEZVOUS, round_: int = 5, culprit: str = "c",
                   kind: str = "worker_crash") -> RunStatus:
    return RunStatus(job_id="J", state=state, round=round_, members=list(FOUR), since=1.0,
                     incident={"kind": kind, "culprit": culprit, "fault_at": 1.0,
                               "detected_at": 1.0, "round": 3, "replicas": [1]})


CARRY_0 = replica_record(5, [3, 5])   # replica 0 (this node's) carried from round 3
BREAK_0 = replica_record(5, [5, 3])   # replica 0 restarted, replica 1 carried
CARRY_0_AGAIN = replica_record(6, [3, 6])  # replica 1 restarted once more
# ranks alive in the round they were launched in, which is over: as the agent sees victims
LAUNCHED3 = Local(3, alive=True, waiting=True, over_s=1.0)

REPLICA_CONVERGE = {
    "carried: the ranks go on, no stop, no launch": (
        replica_status(), CARRY_0, LAUNCHED3, [SeeRound(CARRY_0), CarryOn(CARRY_0), Refill()]),
    "carried, the run already RUNNING when the record is read": (
        replica_status(RUNNING), CARRY_0, LAUNCHED3,
        [SeeRound(CARRY_0), CarryOn(CARRY_0), Refill()]),
    "carried: the culprit's peers elsewhere are not released, not held": (
        replica_status(culprit="b,c"), CARRY_0, LAUNCHED3,
        [SeeRound(CARRY_0), CarryOn(CARRY_0), Refill()]),
    "carried once already, carried again": (
        replica_status(round_=6), CARRY_0_AGAIN, Local(5, alive=True, waiting=True,
                                                       rank_round=3),
        [SeeRound(CARRY_0_AGAIN), CarryOn(CARRY_0_AGAIN), Refill()]),
    "carried and relabelled: left alone": (
        replica_status(RUNNING), CARRY_0, Local(5, alive=True, waiting=True, rank_round=3),
        [SeeRound(CARRY_0), Refill()]),
    # (the incident names the replicas only once the daemon has decided the round)
    "a crash of a rank of this node's replica, before the daemon's decision: killed at once": (
        RunStatus(job_id="J", state=RECOVERING, round=3, members=list(FOUR), since=1.0,
                  incident={"kind": "worker_crash", "culprit": "a", "round": 3}),
        replica_record(3, [3, 3]), LAUNCHED3,
        [StopRound(3, "run is RECOVERING"), SeeRound(replica_record(3, [3, 3])), Refill()]),
    "this node's replica restarted: stopped and launched": (
        replica_status(culprit="a"), BREAK_0, LAUNCHED3,
        [StopRound(3, "round 5 is current"), SeeRound(BREAK_0), Launch(BREAK_0), Refill()]),
    "carried replica, this node's ranks dead: stopped and launched as in world mode": (
        replica_status(), CARRY_0, Local(3, alive=False),
        [StopRound(3, "round 5 is current"), SeeRound(CARRY_0), Launch(CARRY_0), Refill()]),
    "carried replica, ranks of another round than the replica's: stopped": (
        replica_status(), CARRY_0, Local(4, alive=True),
        [StopRound(4, "round 5 is current"), SeeRound(CARRY_0), Launch(CARRY_0), Refill()]),
    "a whole-world recovery after a carry: stopped as in world mode": (
        replica_status(RECOVERING, culprit="c", kind="node_lost"), CARRY_0,
        Local(5, alive=True, waiting=True, rank_round=3),
        [StopRound(5, "run is RECOVERING"), SeeRound(CARRY_0), Refill()]),
    "a crash elsewhere after a carry: released under the round's label": (
        RunStatus(job_id="J", state=RECOVERING, round=5, members=list(FOUR), since=1.0,
                  incident={"kind": "worker_crash", "culprit": "c", "round": 5}),
        CARRY_0, Local(5, alive=True, waiting=True, over_s=1.0, rank_round=3),
        [ReleaseVictims(5), Refill()]),
}


@pytest.mark.parametrize("situation", list(REPLICA_CONVERGE))
def test_converge_replicas(situation):
    st, rec, local, expected = REPLICA_CONVERGE[situation]
    assert converge(NODE, st, rec, local) == expected


VERDICT = HangVerdict(culprits=(1,), reason="hang: rank 1 made no progress", stalled_s=30.0,
                      timeout_s=20.0)

HANG = {
    # situation: (this node's ranks, the detector's verdict, reported already) -> actions
    "no ranks": (NONE, None, False, []),
    "ranks moving": (ALIVE2, None, False, []),
    "ranks stalled": (ALIVE2, VERDICT, False, [ReportHang(VERDICT)]),
    "still stalled, reported": (ALIVE2, VERDICT, True, []),
    "moving again after a report": (ALIVE2, None, True, [WithdrawHang(2)]),
    "ranks exited after a report": (EXITED2, None, True, []),
    "survivors wait for the next round, which is no hang": (SURVIVED2, VERDICT, False, []),
}


@pytest.mark.parametrize("situation", list(HANG))
def test_hang(situation):
    local, verdict, reported, expected = HANG[situation]
    assert hang(local, verdict, reported=reported) == expected


STATE = ("running", 2, None, 0, "healthy", False, False, False, None, None)
OTHER = ("failed", 2, 1, 0, "healthy", False, False, False, None, None)

STATUS_DUE = {
    # situation: (now, state, step, published_state, published_step, published_at, force)
    "never written": (100.0, STATE, 0, None, -1, 0.0, False, True),
    "forced (a rank exited)": (100.0, STATE, 5, STATE, 5, 99.0, True, True),
    "state changed": (100.0, OTHER, 5, STATE, 5, 99.0, False, True),
    "nothing moved, period over": (100.0, STATE, 5, STATE, 5, 50.0, False, False),
    "step moved within the period": (100.0, STATE, 6, STATE, 5, 90.0, False, False),
    "step moved, period over": (100.0, STATE, 6, STATE, 5, 85.0, False, True),
}


@pytest.mark.parametrize("situation", list(STATUS_DUE))
def test_status_due(situation):
    now, state, step, pub_state, pub_step, pub_at, force, due = STATUS_DUE[situation]
    assert status_due(now, state, step, published_state=pub_state, published_step=pub_step,
                      published_at=pub_at, period_s=15.0, force=force) is due


CUT_OFF = {
    # situation: (this node's ranks, etcd away for, lease TTL) -> actions
    "survivors, etcd away past the lease: let go": (
        SURVIVED2, 6.0, 5.0,
        [DropKept("etcd away 6 s, past the lease TTL: this node is lost to the run")]),
    "kept survivors, etcd away past the lease: let go": (
        KEPT, 6.0, 5.0,
        [DropKept("etcd away 6 s, past the lease TTL: this node is lost to the run")]),
    "survivors, etcd away within the lease: kept": (SURVIVED2, 4.0, 5.0, []),
    "ranks training, etcd away long: they train on": (ALIVE2, 600.0, 5.0, []),
}


@pytest.mark.parametrize("situation", list(CUT_OFF))
def test_cut_off(situation):
    local, away, ttl, expected = CUT_OFF[situation]
    assert cut_off(local, away, ttl) == expected


def test_a_replica_node_waits_for_the_record_of_a_newer_round_before_stopping_anything():
    """One transaction wrote the round record and the status; the agent read the status
    first. Whether the round carries its ranks on is in the record: nothing is stopped, and
    no peer is said to be gone, until it is read."""
    old = RoundRecord(round=2, job_id="J", members=["a", "b"], nproc_per_node=1, world_size=2,
                      dp=1, tp=1, store_host="h", store_port=1, replicas=2,
                      replica_rounds=[1, 2], replica_epoch=1)
    st = RunStatus(job_id="J", state="RENDEZVOUS", round=3, members=["a", "b"],
                   incident={"kind": "worker_crash", "culprit": "b", "fault_at": 1.0,
                             "detected_at": 1.0, "round": 2})
    local = Local(round=2, alive=True, waiting=True, rank_round=1)
    assert [type(a).__name__ for a in converge("a", st, old, local)] == ["Refill"]


def test_a_replica_whose_ranks_finished_is_carried_not_started_again():
    """Replica 0 finished its steps while the round that restarts replica 1 was written: its
    node relabels (its status then says it succeeded in the new round), and starts nothing."""
    rec = RoundRecord(round=2, job_id="J", members=["a", "b"], nproc_per_node=1, world_size=2,
                      dp=1, tp=1, store_host="h", store_port=1, replicas=2,
                      replica_rounds=[1, 2], replica_epoch=1)
    st = RunStatus(job_id="J", state="RENDEZVOUS", round=2, members=["a", "b"])
    done = Local(round=1, alive=False, succeeded=True)
    assert [type(a).__name__ for a in converge("a", st, rec, done)] == [
        "SeeRound", "CarryOn", "Refill"]
