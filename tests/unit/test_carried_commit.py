"""A replica
carried on by a replica round (docs/replicas.md, "Checkpoints") commits its saves, fenced on
the round its group was carried into; a stale group's commit is still refused."""

from __future__ import annotations

from lazarus.agent import rounds
from lazarus.agent.decide import CarryOn
from lazarus.agent.messages import on_message
from lazarus.agent.workers import Group
from lazarus.core.records import RoundRecord
from tests.unit.test_agent_messages import FakeEtcd, Running, agent_with


def test_a_carried_replica_commits_under_its_launch_round(tmp_path):
    etcd = FakeEtcd(current=5)
    agent = agent_with(etcd, tmp_path)
    agent.workers.group = Group(round=2, procs={0: Running(100), 1: Running(101)},
                                ranks={0: 0, 1: 1})
    rec = RoundRecord(round=5, job_id="J", members=["a", "b", "c", "d"], nproc_per_node=2,
                      world_size=8, dp=2, tp=1, store_host="127.0.0.1", store_port=1,
                      replicas=2, replica_rounds=[2, 5], replica_epoch=2)
    # before the agent saw the replica round: its launch round is not current
    assert on_message(agent, {"type": "may_commit", "round": 2}) == {"type": "may_commit",
                                                                     "ok": False}
    rounds.act(agent, CarryOn(rec))
    assert on_message(agent, {"type": "may_commit", "round": 2}) == {"type": "may_commit",
                                                                     "ok": True}
    on_message(agent, {"type": "committed", "rank": 0, "round": 2, "step": 40,
                       "path": "/c/step-00000040"})
    (key, claim), = etcd.writes
    assert "ckptclaims/" in key and claim["step"] == 40
    assert claim["round"] == 2  # the claim says its launch round: the daemon adopts it so
    # a newer round (a whole-world one) fences the same group out again
    etcd.current = 6
    assert on_message(agent, {"type": "may_commit", "round": 2})["ok"] is False
