"""Operator commands end to end, typed as an operator types them (`lazarus drain`, `pause`,
`resume`, `uncordon`: the CLI, the daemon's API, the keys it writes, the leader acting on them):
drain a node that runs ranks, pause and resume the run, let the drained node back in. Each
goes through a checkpoint, so no step is lost or changed."""

from __future__ import annotations

import json
import subprocess
import sys
import time


from lazarus.sim.localcluster import LocalCluster
from tests.e2e.helpers import (last_step, lazarus, losses, paused_and_stopped, reference,
                               train_table, wait_for)
from tests.e2e.test_recovery import _start


def test_drain_swaps_in_the_spare_and_pause_resume_keeps_the_curve(tmp_path):
    steps = 36  # the 36-step reference of test_recovery and others: one run for the session
    metrics = tmp_path / "metrics.jsonl"
    with LocalCluster(tmp_path / "cluster", lease_ttl_s=3) as cluster:
        _start(cluster, nodes=2, spares=1, steps=steps, metrics=metrics)
        keys, etcd = cluster.keys, cluster.etcd
        wait_for(cluster, lambda st: st.status and st.status.state == "RUNNING"
                 and last_step(metrics) >= 5, timeout=180, what="step 5")
        assert lazarus(cluster, "drain", "n1").startswith("draining n1")
        st = wait_for(cluster, lambda st: st.status and st.status.round == 2
                      and st.status.state == "RUNNING" and st.status, timeout=300,
                      what="the drain's new round")
        assert st.members == ["n0", "n2"] and st.restarts == 0
        assert etcd.get(keys.cordon_key("n1")) is not None
        assert etcd.get(keys.drain_key("n1")) is None

        # What round 2's ranks have surely done (the metrics file's last line may still be
        # round 1's, past the drain's checkpoint)
        now = cluster.state().node_status
        step_before = min((now[n].step for n in st.members if n in now and now[n].round == 2),
                          default=0)
        assert lazarus(cluster, "pause", "--reason", "upgrade").startswith("pausing run")
        assert json.loads(etcd.get(keys.pause).value)["reason"] == "upgrade"
        st = wait_for(cluster, lambda view: paused_and_stopped(view) and view.status,
                      timeout=120, what="PAUSED, its ranks stopped")
        assert st.restore_step >= step_before
        paused_at = last_step(metrics)
        time.sleep(2)
        assert last_step(metrics) == paused_at  # nothing trains while paused
        assert lazarus(cluster, "resume") == "resuming the run from its last checkpoint\n"
        # The resumed round may start at the last step: on a loaded machine the ranks trained
        # to step 36, the end, before the pause stopped them (it waits for its checkpoint, 32),
        # and the round that restored 36 from memory succeeded 33 ms after it ran, between two
        # looks of this test.
        wait_for(cluster, lambda st: st.status and st.status.round > 2
                 and st.status.state in ("RUNNING", "SUCCEEDED"), timeout=300,
                 what="the resumed round")
        # n1, drained, may take work again: the run has its two nodes, so n1 waits, idle (an
        # active node, not a spare: those are the spare-role ones)
        assert lazarus(cluster, "uncordon", "n1") == "uncordoned n1\n"
        nodes = {n["node"]: n for n in json.loads(lazarus(cluster, "nodes", "--json"))["nodes"]}
        assert (nodes["n1"]["state"], nodes["n1"].get("cordoned", False)) == ("idle", False)
        assert etcd.get(keys.cordon_key("n1")) is None
        final = wait_for(cluster, lambda st: st.status and st.status.state in
                         ("SUCCEEDED", "FAILED") and st.status, timeout=240,
                         what="the run to finish")
        assert final.state == "SUCCEEDED", final.reason
        kinds = [e.kind for e in cluster.new_events()]
    assert "paused" in kinds and "fault_detected" not in kinds
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert losses(metrics) == ref
