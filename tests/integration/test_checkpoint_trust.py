"""A forged checkpoint record, as an agent's etcd credentials could write one before agents
claimed commits instead (ckptclaims/; test_checkpoint_claims): the daemon, reading etcd as it
does, does not restore it (lazarus.daemon.ckptcheck; docs/security.md, "A compromised
agent")."""

from __future__ import annotations

import json

import pytest

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.etcd_rbac import DAEMON_USER
from lazarus.core.records import PENDING, CheckpointRecord, Keys, NodeRecord, RunStatus
from lazarus.daemon import rounds
from lazarus.daemon.actions import Emit, StartRound
from lazarus.daemon.view import LiveView

KEYS = Keys()


@pytest.fixture(scope="module")
def server():
    with EmbeddedEtcd(secure=True) as server:
        yield server


def _commit(ckdir, step: int, job_id: str):
    d = ckdir / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "job_id": job_id,
                                                 "step": step, "commit_seq": 1, "files": []}))
    return d


def test_a_record_forged_by_an_agent_is_not_restored(server, tmp_path):
    ckdir = tmp_path / "ck"
    job = jobspec.from_dict({"job": {"name": "t", "nodes": 1, "min_nodes": 1,
                                     "nproc_per_node": 1, "id": "J"},
                             "train": {"steps": 10, "model": {"name": "tiny"},
                                       "data": {"global_batch": 8},
                                       "checkpoint": {"dir": str(ckdir)}}}, source="test")
    real = _commit(ckdir, 20, "J")
    evil = _commit(tmp_path / "evil", 99, "J")  # the forger's weights, manifest and all
    daemon = E.Etcd(server.endpoint, auth=server.auth(DAEMON_USER))
    # What an older version's agent could write; today only the daemon's role can.
    agent = E.Etcd(server.endpoint, auth=server.auth(DAEMON_USER))
    views = LiveView(daemon, KEYS)
    try:
        E.retry(lambda: daemon.put(KEYS.job, job.to_json()), deadline_s=30)
        daemon.put(KEYS.accepted_job, job.to_json())
        daemon.put(KEYS.node_key("a"), NodeRecord(node="a", host="127.0.0.1", nproc=1,
                                                  store_port=1000).to_json())
        agent.put(KEYS.checkpoint_key(20), CheckpointRecord(
            step=20, path=str(real), round=1, job_id="J").to_json())
        # As an attacker holding an agent's credentials: the largest step, good, this job's.
        agent.put(KEYS.checkpoint_key(99), CheckpointRecord(
            step=99, path=str(evil), round=1, job_id="J").to_json())
        agent.put(KEYS.checkpoint_key(98), CheckpointRecord(
            step=98, path=f"{ckdir}/../evil/step-00000099", round=1, job_id="J").to_json())
        view = views.fresh(5.0)
        assert [c.step for c in view.checkpoints] == [20, 98, 99]
        st = RunStatus(job_id="J", state=PENDING, round=0, members=[], since=0.0)
        d = rounds.start_round(1.0, view, job, st, ["a"], "test", restarts=0)
        start, = [a for a in d.actions if isinstance(a, StartRound)]
        assert (start.record.restore, start.record.restore_step) == (str(real), 20)
        refused = {a.fields["step"]: a.message for a in d.actions
                   if isinstance(a, Emit) and a.kind == "checkpoint_refused"}
        assert set(refused) == {98, 99}
        assert "not a directory of the job's checkpoint dir" in refused[99]
        assert "'..'" in refused[98]
    finally:
        views.stop()
        agent.close()
        daemon.close()
