"""The attacks of one holding an agent's etcd credentials on the run's checkpoints, made as such
an attacker would, against a secured etcd (TLS, authentication, our roles) and the real daemon
loop: records are the leader's to write; agents only claim a commit (ckptclaims/), and the
leader adopts a claim only after its check (lazarus.daemon.ckptcheck; docs/security.md, "A
compromised agent")."""

from __future__ import annotations

import json

import pytest
from aetcd import rpc
from aetcd.utils import prefix_range_end

from lazarus.core import etcd as E
from lazarus.core import etcd_rbac, jobspec
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.etcd_rbac import AGENT_USER, DAEMON_USER, ROOT_USER
from lazarus.core.records import CheckpointRecord, EventRecord, Keys
from lazarus.daemon.service import Daemon

KEYS = Keys()


@pytest.fixture(scope="module")
def server():
    with EmbeddedEtcd(secure=True) as server:
        yield server


@pytest.fixture
def clients(server):
    daemon = E.Etcd(server.endpoint, auth=server.auth(DAEMON_USER))
    agent = E.Etcd(server.endpoint, auth=server.auth(AGENT_USER))
    try:
        E.retry(lambda: daemon.delete(KEYS.root, prefix=True), deadline_s=30)
        yield daemon, agent
    finally:
        agent.close()
        daemon.close()


def _save(ckdir, step: int, job_id: str = "J"):
    d = ckdir / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "job_id": job_id,
                                                 "step": step, "commit_seq": 1, "files": []}))
    return d


def _claim(agent: E.Etcd, step: int, path, **fields) -> None:
    """As an agent claims, fenced on the round (the attacker reads the round like anyone)."""
    round_ = agent.get(KEYS.round)
    rec = {**json.loads(CheckpointRecord(step=step, path=str(path), round=1,
                                         job_id="J").to_json()), **fields}
    compare = [E.value_is(KEYS.round, round_.value)] if round_ is not None else []
    assert agent.txn(compare, [E.put_op(KEYS.claim_key(step), json.dumps(rec).encode())])


def _records(etcd: E.Etcd) -> dict[int, bytes]:
    return {CheckpointRecord.from_json(kv.value).step: kv.value
            for kv in etcd.get_prefix(KEYS.checkpoints).kvs.values()}


def _refusals(etcd: E.Etcd) -> dict[str, str]:
    out = {}
    for kv in etcd.get_prefix(KEYS.events).kvs.values():
        ev = EventRecord.from_json(kv.value)
        if ev.kind == "checkpoint_claim_refused":
            out[ev.fields["key"]] = ev.fields["reason"]
    return out


def test_an_agents_credentials_can_neither_write_nor_delete_a_checkpoint_record(clients):
    daemon, agent = clients
    record = CheckpointRecord(step=20, path="/ck/step-00000020", round=1, job_id="J")
    daemon.put(KEYS.checkpoint_key(20), record.to_json())
    daemon.put(KEYS.round, b"1")
    bad = CheckpointRecord(step=20, path="/ck/step-00000020", round=1, job_id="J", good=False)
    attempts = [
        lambda: agent.put(KEYS.checkpoint_key(20), bad.to_json()),   # mark it bad
        lambda: agent.put(KEYS.checkpoint_key(99), record.to_json()),  # a newer one
        lambda: agent.delete(KEYS.checkpoint_key(20)),                 # lose it
        lambda: agent.delete(KEYS.checkpoints, prefix=True),           # lose them all
        # as the agent committed before, fenced on the round
        lambda: agent.txn([E.value_is(KEYS.round, b"1")],
                          [E.put_op(KEYS.checkpoint_key(20), bad.to_json())]),
        lambda: agent.txn([], [E.delete_op(KEYS.checkpoint_key(20))]),
    ]
    for attempt in attempts:
        with pytest.raises(E.EtcdPermissionDenied):
            attempt()
    assert _records(daemon) == {20: record.to_json()}
    # what it may do: claim a commit, and take back a claim not yet adopted
    _claim(agent, 30, "/ck/step-00000030")
    agent.delete(KEYS.claim_key(30))


def test_enabling_auth_again_revokes_what_an_older_version_granted(server, clients):
    """Operators upgrade by running `lazarus etcd enable-auth` again: the agents' write on
    checkpoints/, which an older version granted, must go."""
    daemon, agent = clients
    root = E.Etcd(server.endpoint, auth=server.auth(ROOT_USER))
    try:
        key = KEYS.checkpoints.encode()
        root.auth_call("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(
            name=AGENT_USER, perm=rpc.Permission(permType=rpc.Permission.READWRITE, key=key,
                                                 range_end=prefix_range_end(key))))
        agent.put(KEYS.checkpoint_key(5), b"{}")  # the hole an older version left
        passwords = {u: p.read_text() for u, p in server.security.password_files.items()}
        etcd_rbac.apply(root, KEYS.root, passwords)
        held = root.auth_call("RoleGet", rpc.AuthRoleGetRequest(role=AGENT_USER)).perm
        granted = {(p.key.decode(), p.permType) for p in held}
        assert granted == {(KEYS.root, rpc.Permission.READ)} | {
            (KEYS.root + p, rpc.Permission.READWRITE) for p in etcd_rbac.AGENT_WRITES}
    finally:
        root.close()
    agent = E.Etcd(server.endpoint, auth=server.auth(AGENT_USER))  # the new password's token
    try:
        with pytest.raises(E.EtcdPermissionDenied):
            agent.put(KEYS.checkpoint_key(5), b"{}")
        with pytest.raises(E.EtcdPermissionDenied):
            agent.delete(KEYS.checkpoint_key(5))
        _claim(agent, 5, "/ck/step-00000005")
    finally:
        agent.close()


def test_forged_claims_are_never_adopted_and_a_record_cannot_be_changed(server, clients,
                                                                         tmp_path):
    daemon_etcd, agent = clients
    ckdir = tmp_path / "ck"
    job = jobspec.from_dict({"job": {"name": "t", "nodes": 1, "min_nodes": 1,
                                     "nproc_per_node": 1, "id": "J"},
                             "train": {"steps": 100, "model": {"name": "tiny"},
                                       "data": {"global_batch": 8},
                                       "checkpoint": {"dir": str(ckdir)}}}, source="test")
    daemon_etcd.put(KEYS.job, job.to_json())
    daemon = Daemon(daemon_etcd, KEYS, lease_ttl_s=3)
    try:
        daemon.step()  # the job accepted: the run waits for nodes
        real = _save(ckdir, 20)
        _claim(agent, 20, real)
        daemon.step()
        records = _records(daemon_etcd)
        assert CheckpointRecord.from_json(records[20]).path == str(real)
        assert daemon_etcd.get_prefix(KEYS.claims).kvs == {}

        evil = _save(tmp_path / "evil", 99)  # the forger's weights, manifest and all
        _claim(agent, 99, evil)
        _claim(agent, 98, _save(ckdir, 98, job_id="OTHER"))
        _claim(agent, 97, f"{ckdir}/../evil/step-00000099")
        # step 20 again, as bad as a claim can say, and of a round to come
        _claim(agent, 20, real, good=False, round=9)
        agent.put(KEYS.claims + "junk", b"\xff")
        daemon.step()
        assert _records(daemon_etcd) == records  # nothing adopted, nothing changed
        assert daemon_etcd.get_prefix(KEYS.claims).kvs == {}  # every claim deleted
        refused = _refusals(daemon_etcd)
        assert "not a directory of the job's checkpoint dir" in refused[f"{99:012d}"]
        assert "manifest is job 'OTHER'" in refused[f"{98:012d}"]
        assert "'..'" in refused[f"{97:012d}"]
        assert "step 20 has a record already (the same save)" in refused[f"{20:012d}"]
        assert "not JSON" in refused["junk"]
    finally:
        daemon.views.stop()
        daemon.leadership.resign()
