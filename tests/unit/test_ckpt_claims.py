"""The leader's adoption of checkpoint claims (ckptclaims/): agents claim a commit, only the
leader writes records (lazarus.daemon.ckptcheck.adopt_claims). Table-driven: preload a view,
call the pure decision, assert the exact actions."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.records import (PENDING, RECOVERING, RUNNING, SUCCEEDED, CheckpointRecord,
                                  Keys, NodeRecord, RunStatus)
from lazarus.daemon import ckptcheck, executor
from lazarus.daemon.actions import (AdoptClaim, Decision, DropClaim, DropClaimsBelow, Emit,
                                    MarkCheckpoint, StartRound)
from lazarus.daemon.decide import decide
from lazarus.daemon.view import MAX_CLAIMS, Claim, ClusterView, parse

KEYS = Keys()
NOW = 1000.0


def _job(ckdir, job_id="J") -> jobspec.JobSpec:
    train = {"steps": 100, "model": {"name": "tiny"}, "data": {"global_batch": 8}}
    if ckdir is not None:
        train["checkpoint"] = {"dir": str(ckdir)}
    return jobspec.from_dict({"job": {"name": "t", "nodes": 1, "min_nodes": 1,
                                      "nproc_per_node": 1, "id": job_id,
                                      "max_restarts": 5},
                              "train": train}, source="test")


def _save(ckdir, step: int, *, job_id="J", seq=1):
    """A committed step as the trainer leaves it (a new `seq`: the step saved again)."""
    d = ckdir / f"step-{step:08d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "job_id": job_id,
                                                 "step": step, "commit_seq": seq,
                                                 "files": []}))
    return d


def _claim(step, path, *, job_id="J", round=1, key=None, rev=50, at=NOW - 1) -> Claim:
    rec = CheckpointRecord(step=step, path=str(path), round=round, job_id=job_id,
                           committed_at=at)
    return Claim(key or KEYS.claim_key(step), rec, rev)


def _view(job, *, claims=(), records=(), state=RUNNING, older=0) -> ClusterView:
    st = RunStatus(job_id="J", state=state, round=1, members=["a"], since=NOW - 1)
    v = ClusterView(revision=100, submitted=job, job=job, status=st, status_mod_revision=5)
    v.nodes = {"a": NodeRecord(node="a", host="127.0.0.1", nproc=1, store_port=1000)}
    v.checkpoints = sorted(records, key=lambda c: c.step)
    v.claims = sorted(claims, key=lambda c: c.key)
    v.older_claims = older
    return v


def _adopted(ckdir, step) -> CheckpointRecord:
    """The record the leader made of an honest claim of `step`."""
    d, _ = _claims_of(ckdir, [(step, _save(ckdir, step))])
    return next(a.record for a in d.actions if isinstance(a, AdoptClaim))


def _claims_of(ckdir, claims, **kw):
    job = _job(ckdir)
    return ckptcheck.adopt_claims(_view(job, claims=[_claim(s, p) for s, p in claims], **kw))


def kinds(actions):
    return [type(a).__name__ + (f":{a.kind}" if isinstance(a, Emit) else "") for a in actions]


@pytest.fixture
def ckdir(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    return d


def test_an_honest_claim_becomes_the_steps_record_and_is_deleted(ckdir):
    path = _save(ckdir, 20)
    d, v = _claims_of(ckdir, [(20, path)])
    assert kinds(d.actions) == ["AdoptClaim"]
    adopt = d.actions[0]
    assert adopt.key == KEYS.claim_key(20)
    rec = adopt.record
    assert (rec.step, rec.path, rec.round, rec.job_id, rec.good) == (20, str(path), 1, "J", True)
    assert len(rec.manifest_sha256) == 64
    # the rest of the pass sees it as a record, committed at the claim's revision
    assert [c.step for c in v.checkpoints] == [20] and v.checkpoint_revision[20] == 50


@pytest.mark.parametrize("case, expect", [
    ("outside", "not a directory of the job's checkpoint dir"),
    ("dotdot", "'..'"),
    ("other_jobs_manifest", "manifest is job 'OTHER'"),
    ("no_manifest", "manifest is unreadable"),
    ("other_job", "it is job 'OTHER''s, not the run's"),
    ("wrong_step_dir", "not the directory of step 30"),
    ("huge_path", "longer than 4096"),
    ("unreadable", "field 'step' has the wrong type"),
    ("key_of_another_step", "claims step 30"),
])
def test_a_forged_claim_is_never_adopted_and_is_deleted_naming_why(tmp_path, ckdir, case,
                                                                    expect):
    evil = _save(tmp_path / "evil", 30)  # the forger's own checkpoint, manifest and all
    claim = {
        "outside": lambda: _claim(30, evil),
        "dotdot": lambda: _claim(30, f"{ckdir}/../evil/step-00000030"),
        "other_jobs_manifest": lambda: _claim(30, _save(ckdir, 30, job_id="OTHER")),
        "no_manifest": lambda: _claim(30, ckdir / "step-00000030"),
        "other_job": lambda: _claim(30, _save(ckdir, 30), job_id="OTHER"),
        "wrong_step_dir": lambda: _claim(30, _save(ckdir, 10)),
        "huge_path": lambda: _claim(30, str(ckdir) + "/." * 100_000 + "/step-00000030"),
        "unreadable": lambda: Claim(KEYS.claim_key(30), None, 50,
                                    "ckptclaims/000000000030: field 'step' has the wrong type"),
        "key_of_another_step": lambda: Claim(KEYS.claim_key(31), None, 50,
                                             "ckptclaims/000000000031: claims step 30"),
    }[case]()
    if case == "no_manifest":
        (ckdir / "step-00000030").mkdir()
    real = CheckpointRecord(step=20, path=str(_save(ckdir, 20)), round=1, job_id="J")
    d, v = ckptcheck.adopt_claims(_view(_job(ckdir), claims=[claim], records=[real]))
    assert kinds(d.actions) == ["DropClaim", "Emit:checkpoint_claim_refused"]
    assert d.actions[0].key == claim.key
    ev = d.actions[1]
    assert expect in ev.message and expect in ev.fields["reason"], ev.message
    assert len(ev.message) < 2000 and len(json.dumps(ev.fields)) < 2000
    assert v.checkpoints == [real]


def test_a_claim_cannot_change_the_record_of_its_step(ckdir):
    """No agent flips `good`, moves a record or loses it: the same save claimed again is
    refused, whatever the claim says."""
    rec = _adopted(ckdir, 20)
    for record in (rec, dataclasses.replace(rec, good=False)):
        claim = _claim(20, ckdir / "step-00000020", round=7)
        d, v = ckptcheck.adopt_claims(_view(_job(ckdir), claims=[claim], records=[record]))
        assert kinds(d.actions) == ["DropClaim", "Emit:checkpoint_claim_refused"]
        assert "step 20 has a record already (the same save)" in d.actions[1].message
        assert v.checkpoints == [record]


def test_the_step_saved_again_after_a_rollback_replaces_its_record(ckdir):
    bad = dataclasses.replace(_adopted(ckdir, 20), good=False)
    _save(ckdir, 20, seq=5)  # the trainer saved step 20 again: another manifest
    d, v = ckptcheck.adopt_claims(_view(_job(ckdir), claims=[_claim(20, ckdir / "step-00000020")],
                                        records=[bad]))
    adopt, = d.actions
    assert isinstance(adopt, AdoptClaim) and adopt.record.good
    assert adopt.record.manifest_sha256 not in ("", bad.manifest_sha256)


def test_an_old_claim_replayed_cannot_bring_back_a_record_marked_bad(ckdir):
    """The daemon's verdicts are cached by (path, step, committed_at); a claim's committed_at
    is the agent's to choose, so one replayed from the first save must not be judged by that
    save's manifest once the step was saved again."""
    job = _job(ckdir)
    path = _save(ckdir, 20)
    first, = ckptcheck.adopt_claims(_view(job, claims=[_claim(20, path, at=1.0)]))[0].actions
    _save(ckdir, 20, seq=5)
    again, = ckptcheck.adopt_claims(_view(job, claims=[_claim(20, path, at=2.0)],
                                          records=[first.record]))[0].actions
    condemned = dataclasses.replace(again.record, good=False)
    d, v = ckptcheck.adopt_claims(_view(job, claims=[_claim(20, path, at=1.0)],
                                        records=[condemned]))
    assert kinds(d.actions) == ["DropClaim", "Emit:checkpoint_claim_refused"]
    assert v.checkpoints == [condemned]


def test_without_the_storage_in_sight_a_record_is_never_replaced(tmp_path):
    job = _job("/nowhere/ck")
    path = "/nowhere/ck/step-00000020"
    old = CheckpointRecord(step=20, path=path, round=1, job_id="J", good=False)
    d, _ = ckptcheck.adopt_claims(_view(job, claims=[_claim(20, path)], records=[old]))
    assert kinds(d.actions) == ["DropClaim", "Emit:checkpoint_claim_refused"]
    assert "cannot tell a new save" in d.actions[1].message
    d, v = ckptcheck.adopt_claims(_view(job, claims=[_claim(30, "/nowhere/ck/step-00000030")]))
    assert kinds(d.actions) == ["AdoptClaim"] and d.actions[0].record.manifest_sha256 == ""


def test_a_job_of_its_own_script_has_its_claims_taken_as_they_are():
    d, _ = ckptcheck.adopt_claims(_view(_job(None), claims=[_claim(5, "/anywhere/5")]))
    assert kinds(d.actions) == ["AdoptClaim"]


@pytest.mark.parametrize("state", [PENDING, RECOVERING, SUCCEEDED])
def test_claims_are_adopted_whatever_the_run_does(ckdir, state):
    d, _ = _claims_of(ckdir, [(20, _save(ckdir, 20))], state=state)
    assert kinds(d.actions) == ["AdoptClaim"]


def test_claims_wait_while_the_runs_job_is_unknown_but_garbage_goes(ckdir):
    job = _job(ckdir)
    garbage = Claim(KEYS.claim_key(9), None, 50, "not JSON")
    v = _view(job, claims=[_claim(20, _save(ckdir, 20)), garbage])
    for unknown in (dataclasses.replace(v, status=None),
                    dataclasses.replace(v, job=dataclasses.replace(job, id="K"))):
        d, _ = ckptcheck.adopt_claims(unknown)
        assert kinds(d.actions) == ["DropClaim", "Emit:checkpoint_claim_refused"]
        assert d.actions[0].key == garbage.key
    assert ckptcheck.adopt_claims(dataclasses.replace(v, claims=[]))[0] is None


def test_a_flood_of_claims_is_cut_to_the_newest_each_pass(ckdir):
    """However many an agent writes, a pass looks at MAX_CLAIMS and deletes the rest."""
    newest = [_claim(s, ckdir / f"step-{s:08d}") for s in range(1000, 1000 + MAX_CLAIMS)]
    d, _ = ckptcheck.adopt_claims(_view(_job(ckdir), claims=newest, older=5000))
    assert d.actions[0] == DropClaimsBelow(KEYS.claim_key(1000))
    assert d.actions[1].kind == "checkpoint_claims_dropped" and d.actions[1].fields == {
        "count": 5000}
    assert kinds(d.actions[2:]) == ["DropClaim", "Emit:checkpoint_claim_refused"] * MAX_CLAIMS


def test_the_view_holds_the_newest_claims_parsed_and_counts_the_rest(ckdir):
    raw = {KEYS.claim_key(s): _claim(s, f"/c/step-{s:08d}").record.to_json()
           for s in range(1, 101)}
    raw[KEYS.claim_key(101)] = b"\xff garbage"
    raw[KEYS.claim_key(102)] = _claim(7, "/c/step-00000007").record.to_json()
    snap = E.Snapshot(revision=500, kvs={k: E.KV(key=k, value=v, create_revision=1,
                                                 mod_revision=10 + i, version=1, lease=0)
                                         for i, (k, v) in enumerate(sorted(raw.items()))})
    v = parse(snap, KEYS)
    assert [c.key for c in v.claims] == [KEYS.claim_key(s) for s in range(95, 103)]
    assert v.older_claims == 94 and not v.ignored
    assert [c.record.step for c in v.claims[:-2]] == list(range(95, 101))
    assert v.claims[-2].record is None and "not JSON" in v.claims[-2].problem
    assert v.claims[-1].record is None and "claims step 7" in v.claims[-1].problem


def test_a_recovery_in_the_same_pass_restores_the_claimed_step(ckdir):
    job = _job(ckdir)
    old = _adopted(ckdir, 10)
    st = RunStatus(job_id="J", state=RECOVERING, round=1, members=["a"], since=NOW - 1,
                   incident={"kind": "worker_crash", "culprit": "a", "fault_at": NOW - 30,
                             "detected_at": NOW - 30, "round": 1})
    v = dataclasses.replace(_view(job, records=[old], claims=[_claim(20, _save(ckdir, 20))]),
                            status=st)
    d = decide(NOW, v)
    start = next(a for a in d.actions if isinstance(a, StartRound))
    assert (start.record.restore, start.record.restore_step) == (
        str(ckdir / "step-00000020"), 20)
    assert isinstance(d.actions[0], AdoptClaim)


def test_a_claim_adopted_as_a_rollback_abandons_it_is_written_once_marked_bad(ckdir):
    """The rollback's MarkCheckpoint and the adoption write the same key: etcd refuses a
    transaction naming a key twice, so the executor keeps the later write."""
    rec = _adopted(ckdir, 20)
    actions = [AdoptClaim(KEYS.claim_key(20), rec), MarkCheckpoint(rec, good=False)]
    ops = executor.operations(KEYS, Decision(actions, "r"), _view(_job(ckdir)), now=NOW,
                              writer="w")
    puts = [op for op in ops if getattr(op, "value", None) is not None]
    assert [op.key for op in puts] == [KEYS.checkpoint_key(20).encode()]
    assert CheckpointRecord.from_json(puts[0].value).good is False
    deletes = [op.key for op in ops if op not in puts]
    assert deletes == [KEYS.claim_key(20).encode()]


def test_the_executor_deletes_the_surplus_in_one_range():
    surplus = Decision([DropClaimsBelow(KEYS.claim_key(1000)), DropClaim(KEYS.claim_key(1001))],
                       "r")
    ops = executor.operations(KEYS, surplus, ClusterView(), now=NOW, writer="w")
    assert [(op.key, op.range_end) for op in ops] == [
        (KEYS.claims.encode(), KEYS.claim_key(1000).encode()),
        (KEYS.claim_key(1001).encode(), None)]


def test_claims_whose_dirs_retention_removed_while_no_leader_led_go_quietly(ckdir):
    """A daemon failover: claims of steps 2, 4 and 6 waited; the trainer kept only step 6's
    directory. Step 6 is recorded, the two older claims are deleted without a refusal event
    (nothing is lost); an older claim alone that fails is still refused aloud."""
    six = _save(ckdir, 6)
    d, _ = _claims_of(ckdir, [(2, ckdir / "step-00000002"), (4, ckdir / "step-00000004"),
                              (6, six)])
    assert kinds(d.actions) == ["AdoptClaim", "DropClaim", "DropClaim"]
    assert "2 older claim(s) that no longer check dropped" in d.reason
    d, _ = _claims_of(ckdir, [(4, ckdir / "step-00000004")])
    assert kinds(d.actions) == ["DropClaim", "Emit:checkpoint_claim_refused"]
