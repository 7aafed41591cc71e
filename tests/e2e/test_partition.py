"""Network partitions end to end: each node in a network namespace of its own (lazarus.sim.netns),
etcd and the daemon on the host's end of their bridge, gloo and the rounds' stores node to
node. A cut is blackhole routes on both sides: packets across it are dropped, and connections
open across it stall instead of failing, as behind a dead switch port.

One cluster, two cuts in turn:
(a) the rank-0 node cut off from etcd, not from its peers: its lease runs out, the daemon
    promotes the spare, the stale rank's saves are refused by the commit gate, the stale
    ranks stop when their peers go, and once the link is back the node registers afresh and
    stays idle;
(b) a member cut off from its peers, not from etcd, until the daemon acts: the collectives
    stall, the hang detector reports it within its allowance, and the run recovers once the
    link is back. Nothing tells a cut from a peer that stopped: the daemon names both members,
    or the one a collective behind. A cut that outlasts the new round's rendezvous is not
    tested: the round keeps the node and fails after rendezvous_timeout_s, again and again
    (docs/architecture.md, "Failure classes").
The run ends on the uninterrupted reference's losses.
"""

from __future__ import annotations

import time

import pytest

from lazarus.core import jobspec
from lazarus.core.contract import STACK_CAPTURE_S
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.records import ROLE_ACTIVE, ROLE_SPARE, W_IDLE
from lazarus.sim import netns
from lazarus.daemon.decide import HANG_REPORT_WAIT_S
from lazarus.sim.localcluster import LocalCluster
from tests.e2e.helpers import last_step, losses, reference, train_table, wait_for
from tests.e2e.test_agent_restart import _alive, _finished

NODES = ("n0", "n1", "s0")
# As the agent-restart test's: a whole TTL must survive an etcd call stalled by the load.
LEASE_TTL_S = 5
# Steps take 0.1-0.3 s, but on a 2-core machine shared with other work one step after a
# save (its writer thread, a GC) took over 2 s: at a 2 s floor that was a hang.
HANG_FLOOR_S = 5
# A recovery's cost past its detection on a loaded 2-core machine: promote or restart warm
# workers, restore the checkpoint, the first step (2-9 s measured). Far below anything a
# timeout would end: the job's rendezvous_timeout_s, gloo's and the store's 300 s.
RESTART_BOUND_S = 30
# The hang detector's own bound: the allowance, the stack capture and the daemon's wait for
# the other members' reports, plus a pass of each loop.
HANG_BOUND_S = HANG_FLOOR_S + STACK_CAPTURE_S + HANG_REPORT_WAIT_S + 4
# A lost node's lease runs out within a TTL of the cut; then etcd's expiry sweep (0.5 s),
# the revoke's watch event and a daemon pass, on a loaded machine.
LOST_BOUND_S = LEASE_TTL_S + 4
# Enough for both cuts and the waits for warm workers before each, on a loaded machine.
STEPS = 160
# What etcd clients need to talk plaintext to etcd off loopback, for daemon and agents alike.
ETCD_PLAINTEXT_FLAGS: list[str] = []  # the embedded etcd says --insecure (EmbeddedEtcd.auth)


@pytest.fixture
def network():
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"network namespaces are not available here: {why}")
    net = netns.NodeNetwork(list(NODES))
    try:
        yield net.up()
    finally:
        net.down()


def _start(cluster: LocalCluster, net: netns.NodeNetwork, metrics) -> None:
    cluster.placement = net.placement
    cluster.agent_args = ["--hang-floor", str(HANG_FLOOR_S), *ETCD_PLAINTEXT_FLAGS]
    cluster.daemon_args = [*ETCD_PLAINTEXT_FLAGS]
    # Plaintext etcd on the bridge, which only this machine's namespaces reach.
    cluster.start_etcd(EmbeddedEtcd(cluster.workdir / "etcd", host=net.host_address).start())
    cluster.start_daemon()
    for node in NODES:
        cluster.start_agent(node, nproc=1, role=ROLE_SPARE if node == "s0" else ROLE_ACTIVE)
    train = train_table(STEPS, checkpoint={"dir": str(cluster.workdir / "ckpt")})
    job = jobspec.from_dict({"job": {"name": "e2e", "nodes": 2, "min_nodes": 1,
                                     "nproc_per_node": 1, "rendezvous_timeout_s": 120},
                             "train": {**train, "metrics": str(metrics)}}, source="test")
    cluster.submit(job)


def _event(events, kind):
    found = [e for e in events if e.kind == kind]
    assert len(found) == 1, [(e.kind, e.message) for e in events]
    return found[0]


def _warm(cluster: LocalCluster, node: str) -> bool:
    """The node's newest worker (the pool's refill after a launch) has finished its imports:
    a recovery then costs what it costs with warm workers, not a second cold start."""
    logs = sorted((cluster.workdir / "nodes" / "logs" / node).glob("worker-*.log"))
    return bool(logs) and '"event": "parked"' in logs[-1].read_text(errors="replace")


def _worker_logs(cluster: LocalCluster, node: str) -> str:
    return "".join(p.read_text(errors="replace")
                   for p in sorted((cluster.workdir / "nodes" / "logs" / node).rglob("*.log")))


def test_a_node_cut_off_from_etcd_and_a_node_cut_off_from_its_peers(tmp_path, network):
    net = network
    metrics = tmp_path / "metrics.jsonl"
    with LocalCluster(tmp_path / "cluster", lease_ttl_s=LEASE_TTL_S) as cluster:
        _start(cluster, net, metrics)
        st = wait_for(cluster, lambda st: st.status and st.status.state == "RUNNING"
                      and last_step(metrics) >= 6 and st, timeout=180,
                      what="the run to reach step 6")
        wait_for(cluster, lambda st: all(_warm(cluster, n) for n in NODES), timeout=120,
                 what="every node's parked workers to be warm")
        # (a) The first member: rank 0, whose saves commit through its agent.
        cut, other = st.status.members
        stale = st.node_status[cut].pids
        net.cut(cut, etcd=True)
        cut_at = time.time()
        st = wait_for(cluster, lambda st: st.status.round > 1 and st.status.state == "RUNNING"
                      and st.status.incident is None and st, timeout=120,
                      what="the run to recover without the node cut off from etcd")
        assert st.status.members == [other, "s0"], st.status
        wait_for(cluster, lambda st: not any(_alive(p) for p in stale), timeout=30,
                 what=f"{cut}'s stale ranks {stale} to stop")
        stale_gone = time.time() - cut_at
        events = cluster.new_events()
        lost, recovered = _event(events, "fault_detected"), _event(events, "recovered")
        assert (lost.fields["kind"], lost.fields["culprit"]) == ("node_lost", cut)
        assert lost.time - cut_at < LOST_BOUND_S, lost.time - cut_at
        assert recovered.time - cut_at < LOST_BOUND_S + RESTART_BOUND_S
        assert stale_gone < LEASE_TTL_S + RESTART_BOUND_S
        print(f"cut from etcd: detected {lost.time - cut_at:.1f} s, recovered "
              f"{recovered.time - cut_at:.1f} s, stale ranks gone {stale_gone:.1f} s after the cut")
        # The stale round's saves were refused at the gate (etcd unreachable, then the
        # round over); nothing of round 1 committed after the cut.
        assert "the commit gate refused" in _worker_logs(cluster, cut)
        assert not [c for c in st.checkpoints if c.round == 1 and c.committed_at > cut_at]

        net.heal(cut)
        st = wait_for(cluster, lambda st: cut in st.nodes and cut in st.node_status
                      and st.node_status[cut].workers == W_IDLE and st, timeout=60,
                      what=f"{cut} to register again once reconnected")
        assert st.node_status[cut].round == 0 and cut not in st.status.members
        log = cluster.agents[cut].log.read_text()
        assert "expired" in log and log.count(f"registered {cut}") == 2, log[-3000:]

        # (b) The promoted spare, cut off from its peers (the idle node too) until the
        # daemon has acted on the hang.
        wait_for(cluster, lambda st: all(_warm(cluster, n) for n in NODES), timeout=120,
                 what="every node's parked workers to be warm")
        at_cut = last_step(metrics)
        assert at_cut < STEPS - 20, "the run nearly finished before the cut"
        net.cut("s0", peers=True)
        cut_at = time.time()
        st = wait_for(cluster, lambda st: st.status.round > 2 and st, timeout=60,
                      what="a new round after the hang")
        net.heal("s0")
        healed_at = time.time()
        st = wait_for(cluster, lambda st: st.status.state == "RUNNING"
                      and st.status.incident is None and st, timeout=120,
                      what="the run to recover from the peer partition")
        events = cluster.new_events()
        hang, recovered = _event(events, "fault_detected"), _event(events, "recovered")
        final = wait_for(cluster, _finished, timeout=300, what="the run to finish")
        events += cluster.new_events()
    assert final.state == "SUCCEEDED", final.reason
    assert hang.fields["kind"] == "hang"
    # Both members' ranks stall in the same collective, or one a collective further on if
    # the cut fell between the two directions of an exchange: both are named, or the one
    # behind, which may be either side of the cut.
    named = set(hang.fields["culprit"].split(","))
    assert named and named <= {other, "s0"}, hang.message
    print(f"cut from peers at step {at_cut}: detected {hang.time - cut_at:.1f} s after the "
          f"cut, healed {healed_at - cut_at:.1f} s, recovered {recovered.time - healed_at:.1f} s "
          f"after that; named {hang.fields['culprit']}: {hang.message[:160]}")
    assert hang.time - cut_at < HANG_BOUND_S, hang.time - cut_at
    assert recovered.time - healed_at < RESTART_BOUND_S
    assert final.members == [other, "s0"] and final.round == 3
    assert [e.fields.get("kind") for e in events if e.kind == "fault_detected"] == ["hang"]
    ref = reference(tmp_path / "ref", train_table(STEPS), nproc=2, dp=2, tp=1)
    assert losses(metrics) == ref
