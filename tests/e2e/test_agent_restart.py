"""An agent restart while its ranks train, end to end (real etcd, daemons, agents, gloo ranks).

Back within the lease TTL -- killed (SIGKILL) or stopped for an upgrade (SIGTERM) -- the new
agent adopts the ranks the old one left running: no recovery, the run stays in round 1, and
its losses are the uninterrupted reference's. An agent that stays away is a node loss as
before, and the ranks it left stop by themselves.
"""

from __future__ import annotations

import signal

import psutil

from lazarus.core import jobspec
from lazarus.core.records import ROLE_ACTIVE, ROLE_SPARE
from lazarus.sim.localcluster import LocalCluster
from tests.e2e.helpers import last_step, losses, reference, train_table, wait_for

# Longer than the local cluster's 3 s: a restarted agent's own start-up (Python, etcd client)
# on a loaded two-core machine must fit in what is left of its lease.
LEASE_TTL_S = 6


def _start(cluster: LocalCluster, *, spares: int, steps: int, metrics) -> None:
    cluster.start_etcd()
    cluster.start_daemon()
    for i in range(2 + spares):
        cluster.start_agent(f"n{i}", nproc=1, role=ROLE_ACTIVE if i < 2 else ROLE_SPARE)
    train = train_table(steps, checkpoint={"dir": str(cluster.workdir / "ckpt")})
    job = jobspec.from_dict({"job": {"name": "e2e", "nodes": 2, "min_nodes": 1,
                                     "nproc_per_node": 1, "rendezvous_timeout_s": 120},
                             "train": {**train, "metrics": str(metrics)}}, source="test")
    cluster.submit(job)



def _alive(pid: int) -> bool:
    try:
        # A zombie has exited; this machine's init may never reap it.
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _finished(st):
    return st.status is not None and st.status.state in ("SUCCEEDED", "FAILED") and st.status


def test_agent_restarts_are_adopted_and_an_agent_that_stays_away_is_a_lost_node(tmp_path):
    """One cluster, three faults in turn: the agent of the store's node killed and started
    again, then stopped for an upgrade and started again, then another node's agent killed
    for good (a spare takes its place)."""
    steps = 160
    metrics = tmp_path / "metrics.jsonl"
    with LocalCluster(tmp_path / "cluster", lease_ttl_s=LEASE_TTL_S) as cluster:
        _start(cluster, spares=1, steps=steps, metrics=metrics)
        st = wait_for(cluster, lambda st: st.status and st.status.state == "RUNNING"
                      and last_step(metrics) >= 6 and st, timeout=180,
                      what="the run to reach step 6")
        # The first member's agent also hosts the round's store.
        host, other = st.status.members
        pids = st.node_status[host].pids
        agent_log = cluster.agents[host].log
        for n, sig in enumerate((signal.SIGKILL, signal.SIGTERM), start=1):
            at = last_step(metrics)
            cluster.kill_agent(host, sig)
            cluster.revive_node(host)
            registered = f"registered {host}"
            wait_for(cluster, lambda st, r=registered, n=n: agent_log.read_text().count(r) == n + 1,
                     timeout=60, what=f"the agent restarted after {sig.name} to register")
            # the ranks go on, and commit through the new agent
            wait_for(cluster, lambda st, at=at: any(c.round == 1 and c.step > at
                                                    for c in st.checkpoints),
                     timeout=120, what="a checkpoint committed through the new agent")
        st = cluster.state()
        assert st.status.state == "RUNNING" and st.status.round == 1, st.status
        assert st.status.restarts == 0
        assert "fault_detected" not in [e.kind for e in cluster.new_events()]
        assert st.node_status[host].pids == pids  # adopted, never relaunched
        log = agent_log.read_text()
        assert log.count(f"pids {' '.join(map(str, pids))} running") == 2, log[-3000:]
        assert log.count("resumed: no node loss") == 2

        orphans = st.node_status[other].pids
        cluster.kill_agent(other)
        final = wait_for(cluster, _finished, timeout=300, what="the run to finish")
        wait_for(cluster, lambda st: not any(_alive(p) for p in orphans), timeout=60,
                 what=f"{other}'s ranks {orphans} to stop without their agent")
        events = cluster.new_events()
    assert final.state == "SUCCEEDED", final.reason
    faults = [e.fields.get("kind") for e in events if e.kind == "fault_detected"]
    assert faults == ["node_lost"]
    assert other not in final.members and final.round == 2
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert losses(metrics) == ref
