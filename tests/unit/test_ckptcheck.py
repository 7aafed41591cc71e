"""The daemon's check of a checkpoint record before it restores it: records come from
agents, and any agent may forge one (lazarus.daemon.ckptcheck)."""

from __future__ import annotations

import json
import os

import pytest

from lazarus.core import jobspec
from lazarus.core.records import CheckpointRecord, NodeRecord, RunStatus, PENDING
from lazarus.daemon import ckptcheck, rounds
from lazarus.daemon.actions import Emit, StartRound
from lazarus.daemon.view import ClusterView


def _job(ckdir: str | None, cwd: str | None = None) -> jobspec.JobSpec:
    train = {"steps": 10, "model": {"name": "tiny"}, "data": {"global_batch": 8}}
    if ckdir is not None:
        train["checkpoint"] = {"dir": ckdir}
    j = {"name": "t", "nodes": 1, "min_nodes": 1, "nproc_per_node": 1, "id": "J"}
    if cwd is not None:
        j["cwd"] = cwd
    return jobspec.from_dict({"job": j, "train": train}, source="test")


def _commit(ckdir, step: int, *, job_id="J", manifest_step=None):
    d = ckdir / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps(
        {"format_version": 1, "job_id": job_id, "step": step if manifest_step is None
         else manifest_step, "commit_seq": 1, "files": []}))
    return d


def _rec(step, path, job_id="J"):
    return CheckpointRecord(step=step, path=str(path), round=1, job_id=job_id)


@pytest.fixture
def ckdir(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    return d


def test_a_committed_directory_of_the_job_passes(ckdir):
    good = _commit(ckdir, 20)
    assert ckptcheck.why_not(_rec(20, good), _job(str(ckdir))) is None


@pytest.mark.parametrize("case, expect", [
    ("outside", "not a directory of the job's checkpoint dir"),
    ("dotdot", "'..'"),
    ("deeper", "not a directory of the job's checkpoint dir"),
    ("wrong_step_name", "not the directory of step 30"),
    ("not_a_step_dir", "not the directory of step 30"),
    ("symlink_out", "not a directory of the job's checkpoint dir"),
    ("no_manifest", "manifest is unreadable"),
    ("other_jobs_manifest", "manifest is job 'OTHER'"),
    ("manifest_of_another_step", "manifest is of step 10"),
])
def test_forged_records_are_refused_naming_why(tmp_path, ckdir, case, expect):
    evil = tmp_path / "evil"
    _commit(evil, 30)  # the forger's own checkpoint, manifest and all
    path = {
        "outside": lambda: evil / "step-00000030",
        "dotdot": lambda: f"{ckdir}/../evil/step-00000030",
        "deeper": lambda: ckdir / "x" / "step-00000030",
        "wrong_step_name": lambda: _commit(ckdir, 10),
        "not_a_step_dir": lambda: ckdir / "latest",
        "symlink_out": lambda: ckdir / "step-00000030",
        "no_manifest": lambda: ckdir / "step-00000030",
        "other_jobs_manifest": lambda: _commit(ckdir, 30, job_id="OTHER"),
        "manifest_of_another_step": lambda: _commit(ckdir, 30, manifest_step=10),
    }[case]()
    if case == "symlink_out":
        os.symlink(evil / "step-00000030", path)
    if case == "no_manifest":
        path.mkdir()
    why = ckptcheck.why_not(_rec(30, path), _job(str(ckdir)))
    assert why is not None and expect in why, why


def test_relative_dirs_are_taken_from_the_jobs_cwd(tmp_path, ckdir):
    good = _commit(ckdir, 20)
    assert ckptcheck.why_not(_rec(20, good), _job("ck", cwd=str(tmp_path))) is None
    assert ckptcheck.why_not(_rec(20, "ck/step-00000020"), _job("ck", cwd=str(tmp_path))) is None
    assert ckptcheck.why_not(_rec(20, tmp_path / "step-00000020"),
                             _job("ck", cwd=str(tmp_path))) is not None


def test_where_the_daemon_does_not_see_the_storage_the_path_checks_remain(tmp_path):
    job = _job("/nowhere/ck")
    assert ckptcheck.why_not(_rec(20, "/nowhere/ck/step-00000020"), job) is None
    assert ckptcheck.why_not(_rec(20, "/elsewhere/step-00000020"), job) is not None


def test_a_round_restores_the_newest_record_that_passes_and_says_why_the_others_did_not(
        tmp_path, ckdir):
    job = _job(str(ckdir))
    real = _commit(ckdir, 20)
    evil = _commit(tmp_path / "evil", 99)
    v = ClusterView(revision=10, submitted=job, job=job, status=None)
    v.nodes = {"a": NodeRecord(node="a", host="127.0.0.1", nproc=1, store_port=1000)}
    v.checkpoints = [_rec(20, real), _rec(99, evil)]
    st = RunStatus(job_id="J", state=PENDING, round=0, members=[], since=0.0)
    d = rounds.start_round(1.0, v, job, st, ["a"], "test", restarts=0)
    start, = [a for a in d.actions if isinstance(a, StartRound)]
    assert (start.record.restore, start.record.restore_step) == (str(real), 20)
    refused = [a for a in d.actions if isinstance(a, Emit) and a.kind == "checkpoint_refused"]
    assert [e.fields["step"] for e in refused] == [99]
    assert "not a directory of the job's checkpoint dir" in refused[0].message
