"""The daemon's view per pass at cluster scale (on demand): `pytest tests/bench/bench_view_cache.py
-m bench -s`.

256, 1,024 and 4,096 nodes x 8 ranks, each node with its registration and a realistic status
(a full throughput window, GPU and host health: ~3.4 KB), a running round, 50 checkpoints and
1,000 events. Per pass, with 1% of the nodes' statuses rewritten since the last one:

- full parse: a snapshot parsed anew (what a pass cost when it read a snapshot per wake-up);
- cached: the informer's changes applied to the parsed records, and a view built from them
  (lazarus.daemon.view.LiveView's work per pass);
- decide: the policy on that view (the straggler judgement over every rank included).
"""

from __future__ import annotations

import time

import pytest

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.records import (RUNNING, CheckpointRecord, EventRecord, Keys, NodeRecord,
                                  NodeStatus, RoundRecord, RunStatus)
from lazarus.core.throughput import ThroughputTracker
from lazarus.daemon.decide import decide
from lazarus.daemon.view import ViewBuilder, parse

pytestmark = pytest.mark.bench

RANKS_PER_NODE = 8
STEPS = 20
KEYS = Keys("/bench/")


def node_status(name: str, index: int, *, step: int = STEPS, ranks: int = RANKS_PER_NODE,
                updated_at: float = 0.0) -> NodeStatus:
    """What an agent of `ranks` ranks in steady training writes (lazarus.agent)."""
    tr = ThroughputTracker()
    for s in range(step - STEPS + 1, step + 1):
        for r in range(index * ranks, (index + 1) * ranks):
            tr.observe(rank=r, step=s, step_time_s=0.2 + 0.001 * (s % 7), tokens=4096,
                       node=name, compute_s=0.15 + 0.001 * ((r * 7 + s * 13) % 11))
    gpus = [{"index": g, "state": "healthy", "reasons": [], "temp_c": 61 + g, "power_w": 402.5,
             "ecc_volatile": 0, "util": 97} for g in range(ranks)]
    return NodeStatus(
        node=name, round=1, workers="running", step=step, loss=2.3456, step_time_s=0.2,
        tokens_per_s=163840.0, pids=[40000 + r for r in range(ranks)], updated_at=updated_at,
        window=[step * 64, step * 64 + 63], throughput=tr.summary(),
        health={"state": "healthy", "gpu": {"state": "healthy", "gpus": gpus},
                "host": {"state": "healthy", "reasons": [], "mem_free_gb": 812.4,
                         "disk_free_gb": 3500.2}},
        long_phase={"since": 0, "until": 0})


def job(nodes: int) -> jobspec.JobSpec:
    return jobspec.from_dict({"job": {"name": "bench", "nodes": nodes, "min_nodes": nodes,
                                      "nproc_per_node": RANKS_PER_NODE, "id": "J"},
                              "train": {"steps": 10**6, "model": {"name": "tiny"},
                                        "data": {"global_batch": nodes * RANKS_PER_NODE}}},
                             source="bench")


def fleet(nodes: int, keys: Keys = KEYS) -> dict[str, bytes]:
    """Every key of a running job on `nodes` nodes, as etcd holds them."""
    names = [f"n{i:05d}" for i in range(nodes)]
    j = job(nodes)
    out = {keys.job: j.to_json(), keys.accepted_job: j.to_json(),
           keys.status: RunStatus(job_id=j.id, state=RUNNING, round=1, members=names,
                                  since=1.0, reason="running").to_json(),
           keys.round_key(1): RoundRecord(round=1, job_id=j.id, members=names,
                                          nproc_per_node=RANKS_PER_NODE,
                                          world_size=nodes * RANKS_PER_NODE, dp=nodes, tp=1,
                                          store_host="10.0.0.1", store_port=29500).to_json()}
    for i, name in enumerate(names):
        out[keys.node_key(name)] = NodeRecord(node=name, host=f"10.0.{i // 250}.{i % 250}",
                                              nproc=RANKS_PER_NODE, store_port=29500).to_json()
        out[keys.nodestatus_key(name)] = node_status(name, i).to_json()
    for step in range(50):
        out[keys.checkpoint_key(step * 100)] = CheckpointRecord(
            step=step * 100, path=f"/ckpt/{step * 100}", round=1, job_id=j.id).to_json()
    for n in range(1000):
        out[f"{keys.events}{n:020d}-bench"] = EventRecord(time=float(n), kind="running",
                                                           message="m").to_json()
    out[keys.root + "run/round"] = b"1"
    return out


def snapshot(values: dict[str, bytes], revision: int) -> E.Snapshot:
    return E.Snapshot(revision=revision, kvs={
        k: E.KV(key=k, value=v, create_revision=1, mod_revision=revision, version=1, lease=0)
        for k, v in values.items()})


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_view_per_pass_from_the_cache_against_a_full_parse():
    rows = []
    for nodes in (256, 1024, 4096):
        values = fleet(nodes)
        size = len(values[KEYS.nodestatus_key("n00000")])
        revision = 100
        snap = snapshot(values, revision)
        t_full = _best(lambda: parse(snap, KEYS), 3)

        builder = ViewBuilder(KEYS)
        builder.apply(snap.kvs.items())
        view = builder.build(revision)
        changed = max(1, nodes // 100)
        rewritten = [node_status(f"n{i:05d}", i, step=STEPS + 1).to_json()
                     for i in range(changed)]
        state = {"revision": revision}

        def cached_pass():
            # what the watch brought since the last pass: 1% of the statuses, rewritten
            state["revision"] += 1
            rev = state["revision"]
            changes = [(KEYS.nodestatus_key(f"n{i:05d}"),
                        E.KV(key=KEYS.nodestatus_key(f"n{i:05d}"), value=value,
                             create_revision=1, mod_revision=rev, version=2, lease=0))
                       for i, value in enumerate(rewritten)]
            builder.apply(changes)
            state["view"] = builder.build(rev)
        t_cached = _best(cached_pass, 5)
        view = state["view"]
        assert len(view.node_status) == nodes and view.node_status["n00000"].step == STEPS + 1
        decide(time.time(), view)  # the first judgement reads every summary once
        t_decide = _best(lambda: (cached_pass(), decide(time.time(), state["view"])), 3) - t_cached
        rows.append((nodes, size, t_full, t_cached, t_decide))
    print(f"\n{'nodes':>6} {'status B':>9} {'full parse':>11} {'cached':>9} {'ratio':>7} "
          f"{'decide':>8}  (seconds per pass; 1% of the nodes wrote since the last)")
    for nodes, size, t_full, t_cached, t_decide in rows:
        print(f"{nodes:>6} {size:>9} {t_full:>11.4f} {t_cached:>9.4f} {t_full / t_cached:>6.0f}x "
              f"{max(0.0, t_decide):>8.4f}")
