"""What `lazarus status` says of a job of replica groups (docs/replicas.md): each replica's
nodes, the round its ranks were launched in, and whether it trains or heals."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lazarus.core.records import RUNNING, RecordError, RoundRecord
from lazarus.daemon import health
from lazarus.ops import client
from tests.unit.test_level0_status import _level0_view


def _replica_view(now: float, *, healing: bool):
    v = _level0_view(now, builtin=True)
    v.round = RoundRecord(round=3, job_id="J", members=["a", "b"], nproc_per_node=2,
                          world_size=4, dp=2, tp=1, store_host="h", store_port=1, replicas=2,
                          replica_rounds=[1, 3], replica_epoch=1)
    incident = ({"kind": "node_lost", "culprit": "c", "fault_at": now - 5,
                 "detected_at": now - 2, "round": 2, "replicas": [1]} if healing else None)
    v.status = dataclasses.replace(v.status, state=RUNNING, round=3, incident=incident)
    return v


def test_status_shows_each_replica_and_which_one_heals(capsys):
    now = 5000.0
    h = health.run_health(_replica_view(now, healing=True), now=now, served_by="d1")
    assert [(r.replica, list(r.members), r.since_round, r.state) for r in h.replicas] == [
        (0, ["a"], 1, "training"), (1, ["b"], 3, "healing")]
    client.render_status(h, now)
    out = capsys.readouterr().out
    assert "replicas    0: a training since round 1; 1: b healing since round 3" in out, out
    # the incident closed: both train
    h = health.run_health(_replica_view(now, healing=False), now=now, served_by="d1")
    assert [r.state for r in h.replicas] == ["training", "training"]


def test_a_job_of_one_world_shows_no_replicas(capsys):
    now = 5000.0
    h = health.run_health(_level0_view(now, builtin=True), now=now, served_by="d1")
    assert not h.replicas
    client.render_status(h, now)
    assert "replicas" not in capsys.readouterr().out


def test_a_round_record_whose_replica_fields_do_not_fit_is_a_clear_error():
    """Garbage in etcd: replicas that do not divide the members, rounds of the future."""
    good = RoundRecord(round=3, job_id="J", members=["a", "b"], nproc_per_node=1, world_size=2,
                       dp=1, tp=1, store_host="h", store_port=1, replicas=2,
                       replica_rounds=[1, 3], replica_epoch=1)
    for change in ({"members": ["a", "b", "c"]}, {"replica_rounds": [1, 4]},
                   {"replica_rounds": [1]}, {"replica_epoch": 2}, {"replicas": 0}):
        doc = {**json.loads(good.to_json()), **change}
        with pytest.raises(RecordError, match="do not fit"):
            RoundRecord.from_json(json.dumps(doc).encode())
