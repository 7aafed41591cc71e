"""Checkpoints in replica mode (docs/replicas.md, "Checkpoints"): which replica saves a step,
and the daemon's adoption of a save by a replica that a replica round carried on (its ranks
still claim under the round they were launched in, older than the run's)."""

from __future__ import annotations

import json

import pytest

from lazarus.core import jobspec
from lazarus.core.records import RUNNING, CheckpointRecord, Keys, NodeRecord, RunStatus
from lazarus.daemon import ckptcheck
from lazarus.daemon.actions import AdoptClaim
from lazarus.daemon.view import Claim, ClusterView
from lazarus.trainer.replicaloop import saver_of


@pytest.mark.parametrize("members, saver", [
    ((0, 1), 0), ((1,), 1), ((1, 2, 3), 1), ((0, 2), 0), ((3,), 3)])
def test_the_lowest_replica_of_the_quorum_saves(members, saver):
    assert saver_of(members) == saver


def test_a_save_by_a_carried_replica_is_adopted_under_its_launch_round(tmp_path):
    ckdir = tmp_path / "ck"
    step_dir = ckdir / "step-00000040"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text(json.dumps(
        {"format_version": 1, "job_id": "J", "step": 40, "commit_seq": 3, "files": []}))
    job = jobspec.from_dict({"job": {"name": "r", "nodes": 2, "min_nodes": 2, "id": "J",
                                     "failure_unit": "replica", "replicas": 2},
                             "train": {"model": {"name": "tiny"}, "data": {"global_batch": 8},
                                       "checkpoint": {"dir": str(ckdir), "every": 20}}},
                            source="test")
    # Replica 0's ranks were launched in round 3; replica 1 was restarted in round 5, the
    # run's round now. Replica 0, the lowest, saved step 40 and claims it under round 3.
    st = RunStatus(job_id="J", state=RUNNING, round=5, members=["a", "b"], since=1.0)
    view = ClusterView(revision=100, submitted=job, job=job, status=st, status_mod_revision=5)
    view.nodes = {n: NodeRecord(node=n, host="127.0.0.1", nproc=1, store_port=1000 + i)
                  for i, n in enumerate(["a", "b"])}
    claim = CheckpointRecord(step=40, path=str(step_dir), round=3, job_id="J",
                             committed_at=2.0)
    view.claims = [Claim(Keys().claim_key(40), claim, 50)]
    decision, after = ckptcheck.adopt_claims(view)
    adopted = [a for a in decision.actions if isinstance(a, AdoptClaim)]
    assert [(a.record.step, a.record.round, a.record.good) for a in adopted] == [(40, 3, True)]
    assert [c.step for c in after.checkpoints] == [40]
