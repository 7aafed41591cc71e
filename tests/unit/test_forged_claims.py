"""Forged checkpoint claims from the job's own code (docs/security.md, "The job's own code"):
a claim is held to `<the job's checkpoint dir>/step-<N>`, a job of its own script included,
and where the daemon cannot see the storage (the shipped Kubernetes daemon mounts none) a
flood of claims that pass that check still cannot push the record the ranks restored out of
etcd (lazarus.daemon.ckptcheck, lazarus.daemon.retention)."""

from __future__ import annotations

import pytest

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.records import (RUNNING, CheckpointRecord, Keys, NodeRecord, RoundRecord,
                                  RunStatus)
from lazarus.daemon import ckptcheck, tier0
from lazarus.daemon.actions import AdoptClaim, DropClaim, Emit
from lazarus.daemon.history import CHECKPOINTS
from lazarus.daemon.retention import Retention, plan
from lazarus.daemon.view import Claim, ClusterView

K = Keys()
NOW = 1_000_000.0
CKDIR = "/nowhere/ck"   # the daemon does not see it: only the path checks remain
SCRIPT = ["python", "train.py"]


def _job(ckdir: str | None = CKDIR, command=None) -> jobspec.JobSpec:
    job = {"name": "t", "nodes": 1, "min_nodes": 1, "nproc_per_node": 1, "id": "J"}
    train = {"steps": 10_000, "model": {"name": "tiny"}, "data": {"global_batch": 8}}
    if command is not None:
        job["command"], train = command, {}
    if ckdir is not None:
        train["checkpoint"] = {"dir": ckdir}
    return jobspec.from_dict({"job": job, "train": train}, source="test")


def _claim(step: int, path: str, rev: int = 50) -> Claim:
    return Claim(K.claim_key(step), CheckpointRecord(step=step, path=path, round=3,
                                                     job_id="J", committed_at=NOW), rev)


def _view(job, claims, st) -> ClusterView:
    v = ClusterView(revision=100, submitted=job, job=job, status=st, status_mod_revision=5)
    v.nodes = {"a": NodeRecord(node="a", host="127.0.0.1", nproc=1, store_port=1000)}
    v.claims = sorted(claims, key=lambda c: c.key)
    return v


def _kv(key: str, value: bytes) -> E.KV:
    return E.KV(key=key, value=value, create_revision=1, mod_revision=1, version=1, lease=0)


def _round(n: int, restore: str | None, step: int) -> E.KV:
    rec = RoundRecord(round=n, job_id="J", members=["a"], nproc_per_node=1, world_size=1,
                      dp=1, tp=1, store_host="h", store_port=1, restore=restore,
                      restore_step=step)
    return _kv(K.round_key(n), rec.to_json())


def test_fifty_forged_claims_do_not_push_the_restored_record_out():
    job = _job()
    real = CheckpointRecord(step=10, path=f"{CKDIR}/step-00000010", round=1, job_id="J",
                            committed_at=NOW - 60)
    # round 2 restored the real one (its ranks found nothing wrong: it is still good); round
    # 3, now running, restored from memory
    st = RunStatus(job_id="J", state=RUNNING, round=3, members=["a"], since=NOW,
                   restore=f"{tier0.LABEL} 12", restore_step=12)
    in_dir = [_claim(s, f"{CKDIR}/step-{s:08d}") for s in range(1000, 1050)]
    elsewhere = [_claim(s, f"/elsewhere/step-{s:08d}") for s in range(2000, 2050)]
    adopted: list[CheckpointRecord] = []
    for batch in (in_dir, elsewhere):   # a pass looks at the newest few: as many passes
        for i in range(0, len(batch), 8):
            d, _ = ckptcheck.adopt_claims(_view(job, batch[i:i + 8], st))
            adopted += [a.record for a in d.actions if isinstance(a, AdoptClaim)]
            refused = [a for a in d.actions if isinstance(a, Emit)]
            if batch is elsewhere:
                assert len(refused) == len([a for a in d.actions if isinstance(a, DropClaim)])
                assert all("is not a directory of the job's checkpoint dir /nowhere/ck"
                           in e.message for e in refused), refused[0].message
    # off the storage the daemon cannot tell the in-dir ones from real commits ...
    assert sorted(r.step for r in adopted) == list(range(1000, 1050))
    records = [_kv(K.checkpoint_key(r.step), r.to_json()) for r in [real, *adopted]]
    snap = E.Snapshot(revision=200, kvs={kv.key: kv for kv in [
        *records, _round(2, real.path, 10), _round(3, None, 12),
        _kv(K.status, st.to_json()), _kv(K.accepted_job, job.to_json())]})
    pruned = [kv.key for kv in plan(NOW, snap, K, Retention())[CHECKPOINTS]]
    # ... but retention keeps what the ranks restored, whatever the count
    assert K.checkpoint_key(10) not in pruned
    assert pruned == []


def test_a_record_a_round_could_not_restore_is_no_longer_kept_for_it():
    job = _job()
    bad = CheckpointRecord(step=10, path=f"{CKDIR}/step-00000010", round=1, job_id="J",
                           good=False)
    newer = [CheckpointRecord(step=s, path=f"{CKDIR}/step-{s:08d}", round=1, job_id="J")
             for s in range(20, 23)]
    st = RunStatus(job_id="J", state=RUNNING, round=3, members=["a"], since=NOW)
    snap = E.Snapshot(revision=9, kvs={kv.key: kv for kv in [
        *(_kv(K.checkpoint_key(r.step), r.to_json()) for r in [bad, *newer]),
        _round(2, bad.path, 10), _kv(K.status, st.to_json()), _kv(K.accepted_job, job.to_json())]})
    assert [kv.key for kv in plan(NOW, snap, K, Retention(checkpoints=2))[CHECKPOINTS]] == [
        K.checkpoint_key(10), K.checkpoint_key(20)]


@pytest.mark.parametrize("path, said", [
    (f"{CKDIR}/step-00000005", None),
    ("/elsewhere/step-00000005", "is not a directory of the job's checkpoint dir"),
    (f"{CKDIR}/step-00000006", "is not the directory of step 5"),
    (f"{CKDIR}/../other-job/step-00000005", "has '..' in it"),
])
def test_a_script_of_the_users_own_is_held_to_its_checkpoint_dir(path, said):
    job = _job(CKDIR, command=SCRIPT)
    assert not job.builtin
    st = RunStatus(job_id="J", state=RUNNING, round=3, members=["a"], since=NOW)
    d, _ = ckptcheck.adopt_claims(_view(job, [_claim(5, path)], st))
    if said is None:
        assert [type(a) for a in d.actions] == [AdoptClaim]
    else:
        drop, event = d.actions
        assert isinstance(drop, DropClaim) and event.kind == "checkpoint_claim_refused"
        assert said in event.fields["reason"], event.fields


def test_a_script_naming_no_checkpoint_dir_has_its_claims_taken_as_they_are():
    """`lazarus run` names no dir: a script's commits are where it puts them (a stated
    limit, docs/security.md); retention still keeps what a round restored from."""
    job = _job(None, command=SCRIPT)
    st = RunStatus(job_id="J", state=RUNNING, round=3, members=["a"], since=NOW)
    d, _ = ckptcheck.adopt_claims(_view(job, [_claim(5, "/anywhere/step-00000005")], st))
    assert [type(a) for a in d.actions] == [AdoptClaim]
