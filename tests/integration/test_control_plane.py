"""The control plane against a real etcd server: fencing, garbage in our keys, leadership."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import pytest

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.service import Agent
from lazarus.daemon.service import Daemon
from lazarus.core.records import NodeRecord, RunStatus
from lazarus.trainer.session import Session


def _job() -> jobspec.JobSpec:
    return jobspec.from_dict({"job": {"name": "t", "nodes": 2, "min_nodes": 1,
                                      "nproc_per_node": 1, "id": "J"},
                              "train": {"steps": 5, "model": {"name": "tiny"},
                                        "data": {"global_batch": 4}}},
                             source="test")


def _register(etcd, keys, *names, lease=None):
    for n in names:
        rec = NodeRecord(node=n, host="127.0.0.1", nproc=1, store_port=1)
        etcd.put(keys.node_key(n), rec.to_json(), lease=lease)


def _submitted(etcd, keys) -> None:
    """Nodes n0 and n1 registered and job J submitted."""
    _register(etcd, keys, "n0", "n1")
    etcd.put(keys.job, _job().to_json())


@contextlib.contextmanager
def _leading(etcd, keys, *, steps: int):
    """A daemon on the submitted job J, `steps` ticks in; it resigns at the end."""
    _submitted(etcd, keys)
    daemon = Daemon(etcd, keys, lease_ttl_s=3)
    try:
        for _ in range(steps):
            daemon.step()
        yield daemon
    finally:
        daemon.leadership.resign()


def _status(etcd, keys) -> RunStatus:
    return RunStatus.from_json(etcd.get(keys.status).value)


def _until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_worker_of_an_old_round_cannot_commit_a_checkpoint(etcd, keys, tmp_path):
    agent = Agent(etcd, keys, AgentConfig(node="n0", nproc=1, role="active", workdir=tmp_path,
                                          park=False))
    try:
        agent.register()
        agent.report.job_id = "J"
        etcd.put(keys.round, b"2")
        stale = Session(socket_path=agent.channel.path, rank=0, round=1)
        current = Session(socket_path=agent.channel.path, rank=0, round=2)
        assert stale.may_commit(10) is False
        assert current.may_commit(12) is True
        stale.checkpoint_committed(10, "/ckpt/10")
        current.checkpoint_committed(12, "/ckpt/12")
        # the agent claims the commit; the daemon makes it the record (test_checkpoint_claims)
        assert _until(lambda: etcd.get(keys.claim_key(12)) is not None)
        assert etcd.get(keys.claim_key(10)) is None
        assert etcd.get_prefix(keys.checkpoints).kvs == {}
        stale.close()
        current.close()
    finally:
        agent.shutdown()


def test_garbage_in_our_keys_is_ignored_and_the_run_starts(etcd, keys):
    garbage = {keys.node_key("junk"): b"\xff\xfe not json",
               keys.nodestatus_key("n0"): b'{"node": "n0", "workers": "dancing"}',
               keys.checkpoint_key(7): b'{"step": "seven"}',
               keys.round_key(3): b"[]",
               keys.root + "unknown/key": b"whatever"}
    for k, v in garbage.items():
        etcd.put(k, v)
    with _leading(etcd, keys, steps=4) as daemon:
        st = _status(etcd, keys)
        assert st.state == "RENDEZVOUS" and st.members == ["n0", "n1"]
        # a garbled submission does not disturb the accepted run
        etcd.put(keys.job, b"{broken")
        daemon.step()
        assert _status(etcd, keys).job_id == "J"


def test_garbled_run_status_is_repaired_not_lost(etcd, keys):
    with _leading(etcd, keys, steps=3) as daemon:
        assert _status(etcd, keys).round == 1
        etcd.put(keys.status, b"garbage typed by hand")
        for _ in range(3):
            daemon.step()
        st = _status(etcd, keys)
        assert st.job_id == "J" and st.round == 2 and st.state == "RENDEZVOUS"
        events = [json.loads(kv.value)["kind"] for kv in etcd.get_prefix(keys.events).kvs.values()]
        assert "status_repaired" in events


def test_two_daemons_never_act_at_once(etcd, keys):
    _submitted(etcd, keys)
    a = Daemon(etcd, keys, lease_ttl_s=2)
    b = Daemon(etcd, keys, lease_ttl_s=2)
    try:
        a.step()
        b.step()
        assert a.leadership.is_leader and not b.leadership.is_leader
        rev_before = etcd.get(keys.status).mod_revision
        b.step()  # the standby writes nothing
        assert etcd.get(keys.status).mod_revision == rev_before
        # the leader's lease is gone (as if it froze past its TTL): b takes over, and a's
        # writes are fenced off even though a still thinks it leads
        a.leadership.session.close(revoke=True)
        b.step()
        assert b.leadership.is_leader
        view_a_epoch = a.leadership.epoch
        assert view_a_epoch != b.leadership.epoch
        ok = etcd.txn([a.leadership.fence()], [E.put_op(keys.status, b"{}")])
        assert ok is False
    finally:
        a.leadership.resign()
        b.leadership.resign()


@pytest.mark.parametrize("body, expect", [
    ("[job]\nnodes = 2\n[train.model]\nname = 'tiny'\n", None),
    ("[job\nnodes=2", "not valid TOML"),
    ("[job]\nnodez = 2\n", "unknown key(s) in [job]: ['nodez']"),
    ("[job]\nnodes = 2\n[train.model]\nnmae = 'tiny'\n", "unknown train setting 'model.nmae'"),
    ("[job]\nnodes = 1\nmin_nodes = 2\n", "min_nodes (2) is more than nodes (1)"),
    ("[job]\nnodes = 2\nnproc_per_node = 2\n[train.parallelism]\ntp = 4\n",
     "tp=4 must divide nproc_per_node=2"),
    ("[job]\nnodes = 3\nmin_nodes = 1\n[train.data]\nglobal_batch = 4\n", "with 3 node(s) (dp=3)"),
    ("[job]\nnodes = 0\n", "[job] nodes must be an integer >= 1"),
    ("[job]\nnodes = 1\n[train.parallelism]\ndp = 4\n", "dp is derived from the node count"),
    ("[job]\nnodes = 1\n[train.model]\nname = 'huge'\n", "huge"),
    ("[job]\nnodes = 1\n[train]\nmodel = 'tiny'\n",
     "train setting 'model' must be a table ([train.model])"),
    ("[job]\ncommand = ['python', '-c', 'pass']\nenv = { A = '1' }\n", None),
    ("[job]\ncommand = ['no-such-trainer', '--lr', '1']\n",
     "[job] command: 'no-such-trainer' is not on PATH here, nor a file (--no-local-check when "
     "this is not an agents' machine)"),
    ("[job]\ncommand = ['python', 'gone.py']\ncwd = '/'\n",
     "[job] command: 'gone.py' is not a readable file in /"),
    ("[job]\ncommand = 'python train.py'\n", "[job] command must be a non-empty list of strings"),
])
def test_submit_rejects_bad_job_files_with_one_line(tmp_path, body, expect, etcd):
    proc = _submit(_job_file(tmp_path, body), "--etcd", etcd.endpoint, "--root", "/test/submit/")
    if expect is None:
        assert proc.returncode == 0, proc.stderr
        assert etcd.get("/test/submit/job") is not None
        return
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], proc.stderr


def _job_file(tmp_path, body: str = "[job]\nnodes = 1\n") -> str:
    path = tmp_path / "job.toml"
    path.write_text(body)
    return str(path)


def _submit(*args: str) -> subprocess.CompletedProcess:
    """`lazarus submit ARGS` in a process of its own, as the operator runs it."""
    return subprocess.run([sys.executable, "-m", "lazarus.cli", "submit", *args],
                          capture_output=True, text=True, timeout=120)


def test_job_file_that_does_not_exist(tmp_path, etcd):
    proc = _submit(str(tmp_path / "no.toml"), "--etcd", etcd.endpoint)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_unreachable_etcd_is_one_clear_line(tmp_path):
    proc = _submit(_job_file(tmp_path), "--etcd", "127.0.0.1:9")
    assert proc.returncode == 1 and "unavailable" in (proc.stdout + proc.stderr)
    assert "Traceback" not in proc.stderr


def test_bad_etcd_endpoint_is_a_user_error(tmp_path):
    proc = _submit(_job_file(tmp_path), "--etcd", "nonsense")
    assert proc.returncode == 2 and "is not HOST:PORT" in proc.stderr


def test_a_rank_flooding_its_agent_cannot_flood_etcd(etcd, keys, tmp_path, caplog):
    """The job's own code on the worker channel (docs/security.md): 300 checkpoint claims with
    paths too long to be one, 300 more with distinct steps, 300 failure reports with escapes
    in them, 100 long-phase flips -- what reaches etcd stays within the per-round budgets
    (lazarus.agent.msglimits), and the agent still answers its ranks."""
    from lazarus.agent import msglimits

    agent = Agent(etcd, keys, AgentConfig(node="n0", nproc=1, role="active", workdir=tmp_path,
                                          park=False))
    try:
        agent.register()
        agent.report.job_id = "J"
        etcd.put(keys.round, b"2")
        # the agent's lease and its node record are the only keys of its own so far
        rev0 = etcd.revision(keys.root)
        started = time.monotonic()
        rank = Session(socket_path=agent.channel.path, rank=0, round=2)
        for step in range(300):
            rank.checkpoint_committed(1000 + step, "/ckpt/" + "x" * 100_000)
        for step in range(300):
            rank.checkpoint_committed(2000 + step, f"/ckpt/step-{2000 + step}/" + "y" * 4000)
            rank.checkpoint_failed(step, "\x1b[2J\x1b[H\x1b[31m" + "z" * 10_000)
        assert rank.may_commit(3000) is True   # answered, after all of it
        elapsed = time.monotonic() - started
        claim_burst, claim_rate = msglimits.LIMITS["claim"]
        event_burst, event_rate = msglimits.LIMITS["event"]
        claims = etcd.get_prefix(keys.claims).kvs
        events = [json.loads(kv.value) for kv in etcd.get_prefix(keys.events).kvs.values()]
        failures = [e for e in events if e["kind"] == "checkpoint_failed"]
        assert 0 < len(claims) <= claim_burst + claim_rate * elapsed + 1
        assert all(len(kv.value) < 5000 for kv in claims.values())
        assert 0 < len(failures) <= event_burst + event_rate * elapsed + 1
        assert all(len(e["fields"]["error"]) <= msglimits.MAX_TEXT for e in failures)
        writes = etcd.revision(keys.root) - rev0
        assert writes <= len(claims) + len(failures) + 5, writes
        said = [r.getMessage() for r in caplog.records
                if "than the agent passes on" in r.getMessage()]
        assert len(said) == 2, said  # once for the claims, once for the failure reports
        rank.close()
    finally:
        agent.shutdown()
