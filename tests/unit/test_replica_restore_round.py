"""A whole-world
round of a replica job restores the newest good checkpoint from storage (docs/replicas.md,
"Checkpoints"); a replica round still heals from a live peer."""

from __future__ import annotations

import dataclasses

from lazarus.core.records import PENDING, RECOVERING, CheckpointRecord, RunStatus
from lazarus.daemon.actions import SetStatus, StartRound
from lazarus.daemon.decide import decide
from tests.unit.test_decide import NOW, only, view
from tests.unit.test_replicaround import NODES, first_round, live, rjob, running


def _ckpts():
    return [CheckpointRecord(step=s, path=f"/ck/step-{s:08d}", round=1, job_id="J",
                             committed_at=NOW - 10 + s / 100, good=s != 30)
            for s in (10, 20, 30)]


def test_the_first_round_of_a_replica_job_resumes_the_newest_good_save():
    v = view(status=RunStatus(job_id="J", state=PENDING, since=NOW - 1), nodes=NODES,
             spares=("s",), j=rjob(), ckpts=_ckpts())
    rec = only(decide(NOW, v).actions, StartRound).record
    assert (rec.restore, rec.restore_step, rec.tier0) == ("/ck/step-00000020", 20, None)
    assert rec.replica_rounds == [rec.round] * 2 and rec.replica_epoch == rec.round


def test_a_whole_world_round_of_a_replica_job_restores_from_storage():
    rec = first_round()
    # the first member's replica and the other both broken: no live peer to heal from
    v = live(rec, node_status=running(a={"0": -9}, c={"4": -9}))
    v.checkpoints = _ckpts()
    st = only(decide(NOW, v).actions, SetStatus).status
    assert st.state == RECOVERING
    v2 = live(rec, RECOVERING, node_status=v.node_status.values(), incident=st.incident)
    v2.status, v2.checkpoints = st, _ckpts()
    new = only(decide(NOW + 0.1, v2).actions, StartRound).record
    assert (new.restore, new.restore_step, new.tier0) == ("/ck/step-00000020", 20, None)
    assert new.replica_epoch == new.round


def test_a_replica_round_heals_and_restores_nothing():
    rec = first_round()
    v = live(rec, node_status=running(c={"4": -9}))
    v.checkpoints = _ckpts()
    new = only(decide(NOW, v).actions, StartRound).record
    assert (new.restore, new.restore_step) == (None, 0)
    assert new.replica_rounds == [rec.round, new.round]


def test_repeated_spikes_roll_every_replica_back_to_a_good_save_before_them():
    """A rollback stays whole-world in this mode (docs/replicas.md): every replica restarts
    from the last good save before the spikes, the spiky data window skipped -- all replicas
    see the same averaged loss, so all report the same spikes."""
    rec = first_round()
    spikes = [{"step": s, "window": [100 + 8 * s, 107 + 8 * s], "loss": 9.0, "reason": "loss"}
              for s in (30, 31, 32)]
    statuses = [dataclasses.replace(s, spikes=spikes) for s in running(step=33)]
    v = live(rec, node_status=statuses)
    # 32 is after the first spike; 25 within good_after_steps (the job's default, 10) of it
    v.checkpoints = [CheckpointRecord(step=s, path=f"/ck/step-{s:08d}", round=1, job_id="J",
                                      committed_at=NOW - 10 + s / 100) for s in (10, 25, 32)]
    d = decide(NOW, v)
    new = only(d.actions, StartRound).record
    st = only(d.actions, SetStatus).status
    assert st.incident["kind"] == "loss_spike"
    assert (new.restore_step, new.tier0) == (10, None), new.restore_step
    assert new.members == list(NODES)
    # a whole-world start of the replicas: a new epoch, every replica in it
    assert new.replica_rounds == [new.round] * 2 and new.replica_epoch == new.round
    assert new.train["data"]["skip_windows"] == [[340, 363]]
