"""A replica
carried on by a replica round (docs/replicas.md, "Checkpoints") commits its saves, fenced on
the round its group was carried into -- also in the gap between etcd's new round and the
agent's next pass; a stale group's commit is still refused."""

from __future__ import annotations

import dataclasses

from lazarus.agent import rounds
from lazarus.agent.decide import CarryOn
from lazarus.agent.messages import on_message
from lazarus.agent.workers import Group
from lazarus.core import etcd as E
from lazarus.core.records import Keys, RoundRecord
from tests.unit.test_agent_messages import FakeEtcd, Running, agent_with


class RecordsEtcd(FakeEtcd):
    """run/round and the round records besides, as the daemon writes them."""

    def __init__(self, *records: RoundRecord):
        super().__init__(current=max(r.round for r in records))
        self.records = {Keys("/t/").round_key(r.round): r.to_json() for r in records}

    def get(self, key):
        if self.away:
            raise E.EtcdUnavailable("away")
        value = str(self.current).encode() if key == Keys("/t/").round else self.records.get(key)
        if value is None:
            return None
        return E.KV(key=key, value=value, create_revision=1, mod_revision=1, version=1, lease=0)


RECORD = RoundRecord(round=5, job_id="J", members=["a", "b", "c", "d"], nproc_per_node=2,
                     world_size=8, dp=2, tp=1, store_host="127.0.0.1", store_port=1,
                     replicas=2, replica_rounds=[2, 5], replica_epoch=2)


def claims(etcd) -> list[dict]:
    return [claim for key, claim in etcd.writes if "ckptclaims/" in key]


def test_a_carried_replica_commits_under_its_launch_round(tmp_path):
    etcd = RecordsEtcd(RECORD)
    agent = agent_with(etcd, tmp_path)
    agent.workers.group = Group(round=2, procs={0: Running(100), 1: Running(101)},
                                ranks={0: 0, 1: 1})
    rounds.act(agent, CarryOn(RECORD))
    assert on_message(agent, {"type": "may_commit", "round": 2}) == {"type": "may_commit",
                                                                     "ok": True}
    on_message(agent, {"type": "committed", "rank": 0, "round": 2, "step": 40,
                       "path": "/c/step-00000040"})
    claim, = claims(etcd)
    assert claim["step"] == 40
    assert claim["round"] == 2  # the claim says its launch round: the daemon adopts it so
    # a newer round (a whole-world one) fences the same group out again
    etcd.records[Keys("/t/").round_key(6)] = dataclasses.replace(
        RECORD, round=6, replicas=1, replica_rounds=[]).to_json()
    etcd.current = 6
    assert on_message(agent, {"type": "may_commit", "round": 2})["ok"] is False


def test_a_commit_in_the_gap_before_the_agent_saw_another_replicas_round_counts(tmp_path):
    """Replica 0 commits a save just as replica 1's round starts in etcd, before this agent's
    pass relabels its group: seen in CI (the save landed 24 ms after the round)."""
    etcd = RecordsEtcd(dataclasses.replace(RECORD, round=3, replica_rounds=[2, 3]),
                       dataclasses.replace(RECORD, round=4, replica_rounds=[2, 4]))
    agent = agent_with(etcd, tmp_path)
    # what the agent's last pass read: the round its group was carried into
    agent.assignments.current = (None, dataclasses.replace(RECORD, round=3, replica_rounds=[2, 3]))
    agent.workers.group = Group(round=3, procs={0: Running(100), 1: Running(101)},
                                ranks={0: 0, 1: 1}, rank_round=2)
    on_message(agent, {"type": "committed", "rank": 0, "round": 2, "step": 75,
                       "path": "/c/step-00000075"})
    claim, = claims(etcd)
    assert (claim["step"], claim["round"]) == (75, 2)


def test_a_stale_group_is_refused_whatever_etcd_carries(tmp_path):
    # the other replica's launch round, or a whole-world round: neither carries these ranks
    etcd = RecordsEtcd(dataclasses.replace(RECORD, replica_rounds=[4, 5]))
    agent = agent_with(etcd, tmp_path)
    agent.assignments.current = (None, RECORD)
    agent.workers.group = Group(round=2, procs={0: Running(100)}, ranks={0: 0})
    assert on_message(agent, {"type": "may_commit", "round": 2})["ok"] is False
    etcd.records = {Keys("/t/").round_key(5): dataclasses.replace(
        RECORD, replicas=1, replica_rounds=[]).to_json()}
    on_message(agent, {"type": "committed", "rank": 0, "round": 2, "step": 40,
                       "path": "/c/step-00000040"})
    assert claims(etcd) == []
    etcd.away = True
    assert on_message(agent, {"type": "may_commit", "round": 2})["ok"] is False


def test_a_whole_world_jobs_refused_message_reads_nothing_more(tmp_path):
    """A rank may send may_commit as often as it likes: outside replica jobs a refusal costs
    the one compare, as before."""
    etcd = RecordsEtcd(dataclasses.replace(RECORD, replicas=1, replica_rounds=[]))
    etcd.get = None  # any read fails the test
    agent = agent_with(etcd, tmp_path)
    agent.assignments.current = (None, dataclasses.replace(RECORD, replicas=1, replica_rounds=[]))
    assert on_message(agent, {"type": "may_commit", "round": 2})["ok"] is False


def test_garbage_in_etcds_round_keys_refuses_the_commit_and_raises_nothing(tmp_path):
    """run/round or the round's record unreadable (a hand edit, a bad restore): the carried
    group's commit is refused as stale, as before the recheck, and the agent goes on."""
    for garbage_round, garbage_record in ((b"not a round", None), (None, b"{not json")):
        etcd = RecordsEtcd(dataclasses.replace(RECORD, round=4, replica_rounds=[2, 4]))
        if garbage_record is not None:
            etcd.records[Keys("/t/").round_key(4)] = garbage_record
        if garbage_round is not None:
            plain = etcd.get
            etcd.get = lambda key, plain=plain: (
                E.KV(key=key, value=garbage_round, create_revision=1, mod_revision=1,
                     version=1, lease=0) if key == Keys("/t/").round else plain(key))
        agent = agent_with(etcd, tmp_path)
        agent.assignments.current = (None, dataclasses.replace(RECORD, round=3,
                                                               replica_rounds=[2, 3]))
        agent.workers.group = Group(round=3, procs={0: Running(100)}, ranks={0: 0},
                                    rank_round=2)
        on_message(agent, {"type": "committed", "rank": 0, "round": 2, "step": 75,
                           "path": "/c/step-00000075"})
        assert claims(etcd) == []
