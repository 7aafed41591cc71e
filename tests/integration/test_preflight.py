"""Preflight end to end: real agents run their checks against a real, secured etcd (the
clock is compared with its leader's over TLS); the real daemon cordons the spare whose
simulated GPU has an uncorrectable ECC error, says why in an event and in `lazarus nodes`,
and leaves the healthy node alone."""

from __future__ import annotations

import json
import subprocess
import sys

from lazarus.agent.gpu_sim import add_fault
from lazarus.core.records import EventRecord, NodeStatus, load_json
from lazarus.sim.chaos import gpu_fault_script
from lazarus.sim.localcluster import LocalCluster
from tests.integration.polling import until


def test_a_spare_failing_preflight_is_cordoned_with_the_reason(tmp_path):
    with LocalCluster(tmp_path / "cluster", lease_ttl_s=3) as cluster:
        cluster.agent_args = ["--no-park"]
        cluster.start_etcd()
        etcd, keys = cluster.etcd, cluster.keys
        # in place before the agent starts: its first checks find it
        (cluster.workdir / "nodes").mkdir(mode=0o700)
        add_fault(gpu_fault_script(cluster.workdir / "nodes", "s0"),
                  {"gpu": 0, "fault": "ecc-dbe"})
        cluster.start_daemon()
        cluster.start_agent("n0", nproc=1, role="active")
        cluster.start_agent("s0", nproc=1, role="spare")

        cordon = until(lambda: etcd.get(keys.cordon_key("s0")), "s0 to be cordoned",
                       timeout=120, every=0.2)
        doc = load_json(cordon.value, "cordon")
        assert doc["by"] == "preflight"
        assert doc["reason"].startswith("gpu: GPU 0 failed: 1 uncorrectable ECC errors"), doc
        events = [EventRecord.from_json(kv.value)
                  for kv in etcd.get_prefix(keys.events).kvs.values()]
        failed = [e for e in events if e.kind == "preflight_failed"]
        assert [e.fields["node"] for e in failed] == ["s0"]
        assert failed[0].message == f"s0 failed its preflight: {doc['reason']}; cordoned"

        # the healthy node passed every check, its clock against etcd's leader included
        n0 = until(lambda: (kv := etcd.get(keys.nodestatus_key("n0"))) and
                   NodeStatus.from_json(kv.value).preflight, "n0's preflight", timeout=60)
        assert n0["state"] == "passed" and n0["reason"] == "" and n0["cost_s"] > 0, n0
        assert etcd.get(keys.cordon_key("n0")) is None

        nodes = subprocess.run(
            [sys.executable, "-m", "lazarus.cli", "nodes", "--address",
             cluster.api_addresses[0], "--token-file", str(cluster.token_file), "--json"],
            capture_output=True, text=True, timeout=60)
        assert nodes.returncode == 0, nodes.stderr
        by_name = {n["node"]: n for n in json.loads(nodes.stdout)["nodes"]}
        assert by_name["s0"]["state"] == "cordoned"
        verdict = next(h for h in by_name["s0"]["health"] if h["monitor"] == "preflight")
        assert verdict["state"] == "failed" and verdict["reasons"] == [doc["reason"]]
        assert next(h for h in by_name["n0"]["health"]
                    if h["monitor"] == "preflight")["state"] == "healthy"
