"""One bad value under any key the daemon reads costs that key, not the run, against a real
etcd and the real daemon loop.

A leader and a standby run while every key kind gets a crafted value (JSON nested 100,000
deep, which once crash-looped every daemon with a RecursionError; bytes that are not UTF-8;
NaN; wrong types nested in a record; a number past 64 bits; a lone surrogate). Both stay up
and name each bad key once in their log; the leader goes on reconciling a fake agent's run (a
worker crash becomes a new round, an unreadable run/status is rebuilt); the API, `lazarus
events` and `lazarus report` still answer. And a node status written under a lease other than
its node's registration (another agent's) is not the node's: the daemon ignores it. An agent
reads around a bad run/status or round record the same way."""

from __future__ import annotations

import json
import logging
import threading
import time

from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.service import Agent
from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.records import (RENDEZVOUS, RUNNING, NodeRecord, NodeStatus, RecordError,
                                  RunStatus)
from lazarus.daemon import api
from lazarus.daemon.service import Daemon
from lazarus.ops import client, report
from tests.agentports import BarePorts
from tests.integration.polling import until

TOKEN = "t0ken"
DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 50_000 + b"1" + b"}" * 50_000


def _job() -> jobspec.JobSpec:
    return jobspec.from_dict({"job": {"name": "bad", "nodes": 1, "min_nodes": 1,
                                      "nproc_per_node": 1, "id": "J", "max_restarts": 100},
                              "train": {"steps": 1000, "model": {"name": "tiny"},
                                        "data": {"global_batch": 4}}}, source="test")


def _status(etcd: E.Etcd, keys) -> RunStatus | None:
    kv = etcd.get(keys.status)
    try:
        return RunStatus.from_json(kv.value) if kv is not None else None
    except RecordError:
        return None


def _until(pred, what: str, timeout: float = 20.0):
    return until(pred, what, timeout=timeout, every=0.02)


def _in_round(etcd, keys, n: int, state: str) -> RunStatus:
    return _until(lambda: (s := _status(etcd, keys)) is not None and s.round == n
                  and s.state == state and s, f"round {n} {state}")


def _report(etcd, keys, session: E.Session, node: str, round_: int, workers: str, **kw) -> None:
    etcd.put(keys.nodestatus_key(node), NodeStatus(node=node, round=round_, workers=workers,
                                                   updated_at=time.time(), **kw).to_json(),
             lease=session.lease)


def test_bad_values_under_every_key_cost_those_keys_only(etcd, keys, tmp_path, capsys, caplog):
    caplog.set_level(logging.WARNING, logger="lazarus.daemon")
    daemons = [Daemon(etcd, keys, lease_ttl_s=3, tick_s=0.05, compact_every_s=0)
               for _ in range(2)]
    stop = threading.Event()
    loops = [threading.Thread(target=d.run, args=(stop,), daemon=True) for d in daemons]
    agent = E.Session(etcd, ttl_s=10)
    srv = None
    try:
        etcd.put(keys.node_key("a"), NodeRecord(node="a", host="127.0.0.1", nproc=1,
                                                store_port=1).to_json(), lease=agent.lease)
        etcd.put(keys.job, _job().to_json())
        for loop in loops:
            loop.start()
        _in_round(etcd, keys, 1, RENDEZVOUS)
        _report(etcd, keys, agent, "a", 1, "running", step=1)
        _in_round(etcd, keys, 1, RUNNING)
        leader = _until(lambda: [d for d in daemons if d.leadership.is_leader], "a leader")[0]
        srv, port = api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN, served_by="d",
                              views=leader.views)

        leader_kv = etcd.get(keys.leader)
        bad = {  # key -> what a reader of that key meets
            keys.job: DEEP,
            keys.round_key(1): DEEP_OBJECT,
            keys.round: b"\xff\xfe",
            keys.node_key("x"): b"\xff\xfe not UTF-8",
            keys.nodestatus_key("x"): b'{"node": "x", "exit_codes": {"0": [1]}, "step": NaN}',
            keys.checkpoint_key(7): b'{"step": 7, "path": "\\ud800", "round": 1}',
            keys.events + "0" * 20 + "-bad": DEEP_OBJECT,
            keys.drain_key("x"): DEEP,
            keys.cancel: DEEP,
            keys.checkpoint_request: b'{"id": ' + b"9" * 5000 + b"}",
            keys.cordon_key("y"): DEEP,
            keys.root + "torchrun/r/state": DEEP,
        }
        for key, value in bad.items():
            etcd.put(key, value)
        # the leader's key keeps its lease: a garbled identity must not cost the failover
        etcd.put(keys.leader, b'{"id": {"nested": [' + b"1e999," * 10 + b'1]}, "pid": 2e70}',
                 lease=leader_kv.lease)
        unreadable = {keys.job, keys.round_key(1), keys.node_key("x"), keys.nodestatus_key("x"),
                      keys.checkpoint_key(7), keys.cancel}
        for d in daemons:
            _until(lambda: unreadable <= set(d.views.current().ignored), "the bad keys named")

        # the leader acts on the keys whose presence is the command (drain x: x runs nothing,
        # so it is cordoned and the drain done) and goes on with the run: a worker crash ...
        _until(lambda: etcd.get(keys.drain_key("x")) is None, "the drain of x done")
        assert etcd.get(keys.cordon_key("x")) is not None
        _report(etcd, keys, agent, "a", 1, "failed", step=5, exit_codes={"0": 1},
                failed_rank=0, fault_at=time.time())
        _in_round(etcd, keys, 2, RENDEZVOUS)
        _report(etcd, keys, agent, "a", 2, "running", step=6)
        _in_round(etcd, keys, 2, RUNNING)
        # ... and an unreadable run/status, rebuilt from the round records
        etcd.put(keys.status, DEEP)
        _in_round(etcd, keys, 3, RENDEZVOUS)
        assert all(loop.is_alive() for loop in loops)
        assert sum(d.leadership.is_leader for d in daemons) == 1

        # each bad key named once by each daemon, not once a pass (run/status is repaired so
        # soon that the standby may not have looked in between)
        for key in unreadable | {keys.status}:
            named = [r for r in caplog.records if r.getMessage().startswith(f"ignoring {key}:")]
            assert len(named) == 2 or key == keys.status and len(named) == 1, (
                key, [r.getMessage()[:200] for r in named])

        # the API, `lazarus events` and `lazarus report` read around the bad values too
        target = ["--address", f"127.0.0.1:{port}", "--token", TOKEN, "--json"]
        capsys.readouterr()
        assert client.status_main(target) == 0
        health = json.loads(capsys.readouterr().out)
        assert health["state"] == RENDEZVOUS and int(health["round"]) == 3
        assert health["leader"]["id"] == '{"nested": [Infinity, Infinity, Infinity, ' \
            'Infinity, Infinity, Infinity, Infinity, Infinity, Infinity, Infinity, 1]}'
        assert client.nodes_main(target) == 0
        assert [n["node"] for n in json.loads(capsys.readouterr().out)["nodes"]] == ["a"]
        assert client.events_main(target) == 0
        kinds = [json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()]
        assert kinds.count("round_started") == 3 and "status_repaired" in kinds
        (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
        report.write(tmp_path, etcd=etcd.endpoint, root=keys.root)
        assert f"skipped {keys.checkpoint_key(7)}: text with a lone UTF-16 surrogate" in \
            capsys.readouterr().err
    finally:
        stop.set()
        for loop in loops:
            loop.join(timeout=10)
        if srv is not None:
            srv.stop(grace=0).wait()
        agent.close()


def test_a_status_under_another_agents_lease_is_not_the_nodes(etcd, keys, caplog):
    caplog.set_level(logging.WARNING, logger="lazarus.daemon")
    daemon = Daemon(etcd, keys, lease_ttl_s=3, compact_every_s=0)
    agent, impostor = E.Session(etcd, ttl_s=10), E.Session(etcd, ttl_s=10)
    try:
        etcd.put(keys.node_key("a"), NodeRecord(node="a", host="127.0.0.1", nproc=1,
                                                store_port=1).to_json(), lease=agent.lease)
        etcd.put(keys.job, _job().to_json())
        daemon.step()
        daemon.step()
        assert _status(etcd, keys).state == RENDEZVOUS
        _report(etcd, keys, agent, "a", 1, "running", step=1)
        daemon.step()
        assert _status(etcd, keys).state == RUNNING

        # another agent, under its own lease, says a's workers failed: nothing happens
        _report(etcd, keys, impostor, "a", 1, "failed", step=1, exit_codes={"0": 1},
                failed_rank=0, fault_at=time.time())
        for _ in range(3):
            daemon.step()
        st = _status(etcd, keys)
        assert (st.state, st.round) == (RUNNING, 1)
        view = daemon.views.current()
        assert "a" not in view.node_status
        why = view.ignored[keys.nodestatus_key("a")]
        assert f"written under lease {impostor.lease:x}, not under" in why
        assert [r.getMessage() for r in caplog.records] == [f"ignoring {why}"]

        # the node's own agent says the same: that is a crash, and a new round
        _report(etcd, keys, agent, "a", 1, "failed", step=1, exit_codes={"0": 1},
                failed_rank=0, fault_at=time.time())
        daemon.step()
        daemon.step()
        st = _status(etcd, keys)
        assert (st.state, st.round) == (RENDEZVOUS, 2)
    finally:
        daemon.leadership.resign()
        daemon.views.stop()
        agent.close()
        impostor.close()


def test_an_agent_reads_around_bad_values_and_names_each_once(etcd, keys, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lazarus.agent")
    agent = Agent(etcd, keys, AgentConfig(node="a", nproc=1, role="active", workdir=tmp_path,
                                          lease_ttl_s=5, monitors=False),
                  BarePorts(tmp_path))  # the agent's state and reads, without its processes
    running = RunStatus(job_id="J", state=RUNNING, round=1, members=["a"], since=time.time())

    etcd.put(keys.status, DEEP)
    assert [agent._read_assignment() for _ in range(3)] == [(None, None)] * 3
    etcd.put(keys.status, running.to_json())
    etcd.put(keys.round_key(1), b'{"round": 1, "job_id": "J", "members": ["a"], '
                                b'"nproc_per_node": 1, "world_size": 1, "dp": 1, "tp": 1, '
                                b'"store_host": "h", "store_port": 1, '
                                b'"train": {"checkpoint": {"dir": ["/c"]}}}')
    assert [agent._read_assignment() for _ in range(3)] == [(running, None)] * 3
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring {keys.status}: nested too deep",
        f"ignoring {keys.round_key(1)}: train.checkpoint.dir is not a path ({{'dir': ['/c']}})"]
