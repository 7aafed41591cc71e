"""The fleet simulator (lazarus.sim.fleet) against a real etcd and the real daemon process:
64 simulated nodes of 8 ranks register and run one round; their ranks commit checkpoints; a
worker crash makes the daemon restart the same members from the last checkpoint, and a node
loss makes it promote a spare. What the simulated agents wrote is read back as the records
real agents write."""

from __future__ import annotations

import subprocess
import sys
import time


from lazarus.agent.assignment import REREAD_S
from lazarus.core.records import (
    ROLE_SPARE,
    RUNNING,
    W_RUNNING,
    CheckpointRecord,
    NodeRecord,
    NodeStatus,
    RoundRecord,
)
from lazarus.sim.fleetrun import FleetRun, fleet_config
from tests.integration.polling import until

# A whole local cluster (etcd, daemon, agents, ranks): `-m "not e2e"` leaves it out.
NODES, SPARES, NPROC = 64, 2, 8


def _until(pred, what: str, timeout: float = 30.0):
    return until(pred, what, timeout=timeout, every=0.1)


def test_a_simulated_fleet_trains_and_recovers_under_the_real_daemon(tmp_path):
    config = fleet_config(NODES, spares=SPARES, nproc=NPROC, lease_ttl_s=3, step_time_s=0.25,
                          startup_s=0.2, checkpoint_every=4, return_after_s=None)
    with FleetRun(config, tmp_path) as run:
        run.start(timeout_s=60)
        etcd, keys, fleet = run.etcd, run.keys, run.fleet
        st = fleet.status
        assert st.state == RUNNING and st.round == 1
        assert sorted(st.members) == [f"n{i:05d}" for i in range(NODES)]

        # the records are the real ones: registrations under leases, and node statuses with
        # every rank's throughput summary
        snap = etcd.snapshot([keys.nodes, keys.nodestatus])
        nodes = [NodeRecord.from_json(kv.value) for kv in snap.prefix(keys.nodes).values()]
        assert len(nodes) == NODES + SPARES and all(kv.lease for kv in snap.kvs.values())
        assert sum(n.role == ROLE_SPARE for n in nodes) == SPARES
        statuses = {s.node: s for s in (NodeStatus.from_json(kv.value)
                                        for kv in snap.prefix(keys.nodestatus).values())}
        for node in st.members:
            assert statuses[node].round == 1 and statuses[node].workers == W_RUNNING
            assert len(statuses[node].pids) == NPROC

        # an agent reads its assignment on news from its watches, else every REREAD_S -- not
        # on each of its reconciles (twice a second: 16,000 reads/s at 4,096 nodes)
        reads0, t0 = sum(a.assignments.reads for a in fleet.agents.values()), time.monotonic()
        time.sleep(5)
        per_agent_s = ((sum(a.assignments.reads for a in fleet.agents.values()) - reads0)
                       / (NODES + SPARES) / (time.monotonic() - t0))
        assert per_agent_s <= 1 / REREAD_S + 0.2, per_agent_s

        # global rank 0's agent commits checkpoints, fenced on the round
        ckpt = _until(lambda: [CheckpointRecord.from_json(kv.value) for kv in
                               etcd.get_prefix(keys.checkpoints).kvs.values()],
                      "a committed checkpoint")[-1]
        assert ckpt.round == 1 and ckpt.step % 4 == 0

        crash = run.fault("worker_crash")
        assert crash.new_round == 2 and crash.at <= crash.seen_at <= crash.committed_at
        rec = RoundRecord.from_json(etcd.get(keys.round_key(2)).value)
        assert sorted(rec.members) == sorted(st.members)
        # from the ranks' snapshots in memory (tier 0), no older than the last checkpoint
        assert rec.tier0 is not None and rec.restore_step == rec.tier0["step"] >= ckpt.step
        # the statuses say what real nodes' do: the tier-0 copies each holds (its own ranks'
        # and its ring predecessor's), and the ranks that went on in place
        statuses = _until(lambda: (got := {s.node: s for s in (
            NodeStatus.from_json(kv.value) for kv in
            etcd.get_prefix(keys.nodestatus).kvs.values())}) and all(
                got[n].round == 2 and got[n].tier0.get("ranks") for n in rec.members) and got,
            "every member's status of round 2")
        for i, node in enumerate(rec.members):
            held = statuses[node].tier0["ranks"]
            before = (i - 1) % NODES
            assert {int(r) for r in held} >= set(range(i * NPROC, (i + 1) * NPROC)) | set(
                range(before * NPROC, (before + 1) * NPROC)), (node, held)
            # the crashed rank's peers elsewhere are held until they said they survived; on
            # its own node they go on in place only if they said so before the round ended
            if node != crash.node:
                assert len(statuses[node].in_place) == NPROC, (node, statuses[node])

        lost = run.fault("node_lost")
        assert lost.new_round == 3 and lost.at <= lost.seen_at <= lost.committed_at
        st = fleet.status
        assert st.state == RUNNING and len(st.members) == NODES
        assert lost.node not in st.members
        assert any(m.startswith("s") for m in st.members)  # a spare took its place


def test_a_fleet_of_no_nodes_is_one_clear_error():
    out = subprocess.run([sys.executable, "-m", "lazarus.cli", "fleet", "--nodes", "0"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "lazarus fleet: error: a fleet needs --nodes >= 1, --nproc >= 1 and --spares >= 0"]
