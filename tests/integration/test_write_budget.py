"""The write budget (docs/architecture.md, "Write budget"): a small real cluster -- etcd, a
daemon, two active agents and a spare, real workers training -- writes at most 0.1 times a
second per node to etcd in steady training, counted from etcd's own revisions."""

from __future__ import annotations

import collections
import threading
import time


from lazarus.agent.agentconfig import STATUS_PERIOD_S
from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.records import RUNNING
from lazarus.sim.localcluster import LocalCluster
from tests.e2e.helpers import last_step

# A whole local cluster (etcd, daemon, agents, ranks): `-m "not e2e"` leaves it out.
BUDGET = 0.1            # writes/s per node in steady state
MEASURE_S = 40.0        # two to three status periods of every node (15 s, jittered)


def _job(tmp_path) -> jobspec.JobSpec:
    return jobspec.from_dict({
        "job": {"name": "budget", "nodes": 2, "min_nodes": 1, "nproc_per_node": 1,
                "rendezvous_timeout_s": 120},
        # No checkpoints in the window: a save is two state changes per node (into the save
        # and out of it) and one record, which the budget counts apart.
        "train": {"steps": 1_000_000, "model": {"name": "tiny"},
                  "data": {"global_batch": 4, "seq_len": 32},
                  "metrics": str(tmp_path / "metrics.jsonl")},
        # This machine's noise must not read as a straggler and swap a node mid-measurement.
        "policy": {"straggler_margin": 10.0}}, source="test")


def _wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")



def test_steady_training_stays_within_the_write_budget(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    with LocalCluster(tmp_path) as cluster:
        # the agents' own default, not the local cluster's demo pace
        cluster.agent_args = ["--status-period", str(STATUS_PERIOD_S)]
        cluster.start_etcd()
        cluster.start_daemon()
        for node, role in (("n0", "active"), ("n1", "active"), ("s0", "spare")):
            cluster.start_agent(node, nproc=1, role=role)
        cluster.submit(_job(tmp_path))

        def steady() -> bool:
            # Past the first window of steps: every rank's throughput summary is complete.
            # Rank 0's metrics say so at once (the ranks step together); the node statuses
            # would say it up to a status period (15 s) later.
            st = cluster.state()
            return (st.status is not None and st.status.state == RUNNING
                    and last_step(metrics) >= 31)
        _wait(steady, 240, "steady training")
        round_ = cluster.state().status.round

        writes: collections.Counter = collections.Counter()
        lock = threading.Lock()

        def count(events) -> None:
            with lock:
                for ev in events:
                    writes[f"{ev.kind} {ev.kv.key}"] += 1
        start = cluster.etcd.snapshot([cluster.keys.leader]).revision
        t0 = time.monotonic()
        # the root: all the daemon's etcd user may read (etcd runs with roles)
        root = cluster.keys.root
        watch = cluster.etcd.watch_prefix(root, start_revision=start + 1, on_events=count,
                                          on_resync=lambda: E.retry(
                                              lambda: cluster.etcd.snapshot([root]),
                                              deadline_s=10).revision + 1)
        time.sleep(MEASURE_S)
        end = cluster.etcd.snapshot([cluster.keys.leader]).revision
        elapsed = time.monotonic() - t0
        watch.cancel()
        st = cluster.state()

    assert st.status.state == RUNNING and st.status.round == round_, st.status
    per_node = (end - start) / elapsed / 3
    assert per_node <= BUDGET, (f"{end - start} writes in {elapsed:.0f} s from 3 nodes "
                                f"({per_node:.3f}/s per node): {dict(writes)}")
