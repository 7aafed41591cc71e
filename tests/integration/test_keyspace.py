"""A long run in fast motion against a real etcd and the real daemon loop: a hundred rounds,
each with its events and a checkpoint, go past the retention. The keys under the root stay
bounded, what left etcd is in the daemon's history files, and `lazarus events` (over the API)
still lists every event of the run, in order."""

from __future__ import annotations

import json
import threading
import time

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.records import (RENDEZVOUS, RUNNING, CheckpointRecord, EventRecord,
                                  NodeRecord, NodeStatus, RunStatus)
from lazarus.daemon import api
from lazarus.daemon.history import EVENTS, History
from lazarus.daemon.leader import Leadership
from lazarus.daemon.retention import Pruner, Retention
from lazarus.daemon.service import Daemon
from lazarus.ops import client
from tests.integration.polling import until

ROUNDS = 100   # twenty times the rounds the retention keeps
RETENTION = Retention(events=30, rounds=5, checkpoints=5)
# job, run/job, run/status, run/round, leader, nodes/a, nodestatus/a
FIXED_KEYS = 7
# A round's worth of records written between two prunes (every pass, here): the slack over
# the retention while the run goes on.
SLACK = 10
TOKEN = "t0ken"


def _job() -> jobspec.JobSpec:
    return jobspec.from_dict({"job": {"name": "long", "nodes": 1, "min_nodes": 1,
                                      "nproc_per_node": 1, "id": "J", "max_restarts": 10_000},
                              "train": {"steps": 10**6, "model": {"name": "tiny"},
                                        "data": {"global_batch": 4}}}, source="test")


def _status(etcd, keys) -> RunStatus | None:
    kv = etcd.get(keys.status)
    return RunStatus.from_json(kv.value) if kv is not None else None


def _until(pred, what: str, timeout: float = 20.0):
    return until(pred, what, timeout=timeout, every=0.01)


def test_a_long_run_keeps_a_bounded_keyspace_and_its_whole_history(etcd, keys, tmp_path,
                                                                   capsys):
    history = History.at(tmp_path, keys)
    daemon = Daemon(etcd, keys, lease_ttl_s=3, tick_s=0.05, compact_every_s=0,
                    history=history, retention=RETENTION)
    daemon.pruner.every_s = 0.0        # a prune every pass: weeks in a few seconds
    stop = threading.Event()
    loop = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    srv, port = api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN, served_by="d",
                          history=history)
    session = E.Session(etcd, ttl_s=10)
    most_keys = 0
    try:
        etcd.put(keys.node_key("a"), NodeRecord(node="a", host="127.0.0.1", nproc=1,
                                                store_port=1).to_json(), lease=session.lease)
        etcd.put(keys.job, _job().to_json())
        loop.start()
        for n in range(1, ROUNDS + 1):
            # the agent of node a, as the daemon sees it: round n starts, trains, checkpoints,
            # and its worker crashes, which makes round n + 1
            _until(lambda: (s := _status(etcd, keys)) is not None and s.round == n
                   and s.state == RENDEZVOUS, f"round {n}")
            etcd.put(keys.nodestatus_key("a"), NodeStatus(node="a", round=n, workers="running",
                                                          step=n * 10).to_json(),
                     lease=session.lease)
            _until(lambda: _status(etcd, keys).state == RUNNING, f"round {n} running")
            etcd.put(keys.checkpoint_key(n * 10), CheckpointRecord(
                step=n * 10, path=f"/ckpt/{n * 10}", round=n, job_id="J",
                committed_at=time.time()).to_json())
            etcd.put(keys.nodestatus_key("a"), NodeStatus(
                node="a", round=n, workers="failed", exit_codes={"0": 1}, failed_rank=0,
                step=n * 10, fault_at=time.time()).to_json(), lease=session.lease)
            most_keys = max(most_keys, len(etcd.get_prefix(keys.root).kvs))
        _until(lambda: _status(etcd, keys).round == ROUNDS + 1, "the last round")
        # the loop prunes once more after the last writes
        bound = RETENTION.events + RETENTION.rounds + RETENTION.checkpoints + FIXED_KEYS
        _until(lambda: len(etcd.get_prefix(keys.root).kvs) <= bound, "the final prune")

        assert most_keys <= bound + SLACK, most_keys
        archived = history.read(EVENTS)
        assert len(archived) >= 3 * ROUNDS - RETENTION.events   # most events left etcd ...
        in_etcd = etcd.get_prefix(keys.events).kvs
        assert len(in_etcd) <= RETENTION.events
        assert not set(archived) & set(in_etcd)                  # ... each one exactly once

        rc = client.events_main(["--address", f"127.0.0.1:{port}", "--token", TOKEN, "--json"])
        out = capsys.readouterr().out
        assert rc == 0
        listed = [json.loads(line) for line in out.splitlines()]
        kinds = [ev["kind"] for ev in listed]
        assert kinds[:3] == ["job_accepted", "round_started", "running"]
        assert kinds.count("round_started") == ROUNDS + 1
        assert kinds.count("fault_detected") == ROUNDS
        assert len(listed) == len(archived) + len(in_etcd)
        assert [ev["time"] for ev in listed] == sorted(ev["time"] for ev in listed)
        # the run's acceptance left etcd long ago: its goodput still counts from there
        rc = client.status_main(["--address", f"127.0.0.1:{port}", "--token", TOKEN, "--json"])
        health = json.loads(capsys.readouterr().out)
        assert rc == 0 and health["goodput"] >= 0
        assert health["wall_time_s"] >= listed[-1]["time"] - listed[0]["time"]
    finally:
        stop.set()
        loop.join(timeout=10)
        srv.stop(grace=0).wait()
        session.close()


def test_a_deposed_leader_prunes_nothing(etcd, keys, tmp_path):
    for i in range(5):
        etcd.put(keys.event_key(f"w{i}"), EventRecord(time=time.time(), kind="k",
                                                      message=str(i)).to_json())
    old = Leadership(etcd, keys, ttl_s=3, identity={"id": "old"})
    assert old.campaign()
    etcd.delete(keys.leader)            # its lease outlived by a new leader's election
    new = Leadership(etcd, keys, ttl_s=3, identity={"id": "new"})
    assert new.campaign()
    try:
        pruner = Pruner(etcd, keys, History.at(tmp_path, keys), Retention(events=1))
        assert old.is_leader                # it has not noticed yet
        assert pruner.tick(old) == 0
        assert len(etcd.get_prefix(keys.events).kvs) == 5
        assert not old.is_leader            # the failed write told it
        assert Pruner(etcd, keys, History.at(tmp_path, keys), Retention(events=1)).tick(new) == 4
        assert len(etcd.get_prefix(keys.events).kvs) == 1
    finally:
        old.resign()
        new.resign()
