"""The policy's restore choice across tiers (daemon/rounds.py with daemon/tier0.py): table
tests of decide() with nodes that report tier-0 copies in their status."""

from __future__ import annotations

import dataclasses

from lazarus.core.records import RECOVERING, RENDEZVOUS, CheckpointRecord
from lazarus.daemon.actions import Emit, MarkCheckpoint, SetStatus, StartRound
from lazarus.daemon.decide import decide
from tests.unit.test_decide import NOW, ns, only, status, view

CKPT = [CheckpointRecord(step=8, path="/c/8", round=1, job_id="J")]


def held(ranks: dict[int, list[int]]) -> dict:
    return {"job": "J", "world": 4, "ranks": {str(r): s for r, s in ranks.items()},
            "bytes": 100, "limit": 1000}


def recovering(**kw):
    inc = {"kind": "worker_crash", "culprit": "b", "fault_at": NOW - 1, "detected_at": NOW - 1,
           "round": 1}
    return dataclasses.replace(status(RECOVERING, since=NOW - 0.5), incident=inc, **kw)


def test_a_crash_restores_the_newest_step_in_memory_each_node_from_its_own_copies():
    a = ns("a", "failed", step=13, updated_at=NOW - 0.5,
           tier0=held({0: [12, 11], 1: [12, 11], 2: [11, 10], 3: [11, 10]}))
    b = ns("b", "failed", step=13, updated_at=NOW - 0.8,
           tier0=held({2: [12, 11], 3: [12, 11], 0: [12, 11], 1: [12, 11]}))
    d = decide(NOW, view(status=recovering(), ckpts=CKPT, node_status=[a, b]))
    rec = only(d.actions, StartRound).record
    assert rec.tier0 == {"step": 12, "sources": {"0": "a", "1": "a", "2": "b", "3": "b"}}
    assert (rec.restore, rec.restore_step) == (None, 12)
    assert only(d.actions, SetStatus).status.restore == "memory (tier 0) step 12"
    ev = only(d.actions, Emit)
    assert "restoring step 12 from memory (tier 0)" in ev.message
    assert ev.fields["restore_tier"] == 0 and ev.fields["restore_step"] == 12


def test_a_lost_node_s_ranks_come_from_its_peer_and_storage_wins_when_newer():
    a = ns("a", "failed", step=13, updated_at=NOW - 0.5,
           tier0=held({0: [12, 11], 1: [12, 11], 2: [12, 11], 3: [11, 10]}))
    v = view(status=recovering(), nodes=("a",), spares=("s",), ckpts=CKPT, node_status=[a])
    rec = only(decide(NOW, v).actions, StartRound).record
    assert rec.members == ["a", "s"]
    assert rec.tier0 == {"step": 11, "sources": {"0": "a", "1": "a", "2": "a", "3": "a"}}
    newer = [*CKPT, CheckpointRecord(step=12, path="/c/12", round=1, job_id="J")]
    d = decide(NOW, view(status=recovering(), nodes=("a",), spares=("s",), ckpts=newer,
                         node_status=[a]))
    rec = only(d.actions, StartRound).record
    assert (rec.tier0, rec.restore, rec.restore_step) == (None, "/c/12", 12)
    assert "restoring step 12 from storage (tier 1)" in only(d.actions, Emit).message


def test_a_holder_that_reported_before_the_fault_is_waited_for_a_moment():
    a = ns("a", "running", step=13, updated_at=NOW - 5,  # before the fault: out of date
           tier0=held({0: [6, 5], 1: [6, 5], 2: [6, 5], 3: [6, 5]}))
    b = ns("b", "failed", step=13, updated_at=NOW - 0.5, tier0=held({2: [12], 3: [12]}))
    d = decide(NOW, view(status=recovering(), ckpts=CKPT, node_status=[a, b]))
    assert d.actions == [] and "waiting up to 3 s for a" in d.reason
    assert d.awaiting == ("a",)  # the daemon passes again as soon as it has reported
    # past the wait: decided on what is known (storage's step 8 beats memory's 6)
    late = recovering(since=NOW - 3)
    rec = only(decide(NOW, view(status=late, ckpts=CKPT, node_status=[a, b])).actions,
               StartRound).record
    assert (rec.tier0, rec.restore_step) == (None, 8)


def test_a_restore_from_memory_that_fails_goes_to_storage_and_condemns_no_checkpoint():
    st = status(RENDEZVOUS, round=2, restore="memory (tier 0) step 12", restore_step=12)
    copies = held({0: [12], 1: [12], 2: [12], 3: [12]})
    nodes = [ns("a", "failed", round=2, exit_codes={"0": 76}, failed_rank=0, fault_at=NOW,
                updated_at=NOW, tier0=copies),
             ns("b", "failed", round=2, exit_codes={"0": 76}, failed_rank=2, fault_at=NOW,
                updated_at=NOW, tier0=copies)]
    d = decide(NOW, view(status=st, ckpts=CKPT, node_status=nodes))
    assert not [a for a in d.actions if isinstance(a, MarkCheckpoint)]
    st2 = only(d.actions, SetStatus).status
    assert st2.incident["kind"] == "bad_checkpoint"
    rec = only(decide(NOW + 0.1, view(status=st2, ckpts=CKPT, node_status=nodes)).actions,
               StartRound).record
    assert (rec.tier0, rec.restore, rec.restore_step) == (None, "/c/8", 8)
