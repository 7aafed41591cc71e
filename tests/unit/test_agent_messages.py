"""The agent's handling of its ranks' messages (lazarus.agent.messages), on the agent's
process-free state: what each message changes, what a stale round's message does not, and
what the fenced ones write to etcd."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lazarus.agent import nodestatus, rounds
from lazarus.agent.adopt import Left, LeftRank
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.decide import CarryOn, ReleaseVictims
from lazarus.agent.messages import MAX_SPIKES, on_message, pass_on_checkpoint_request
from lazarus.agent.roundreport import RoundReport
from lazarus.agent.service import Agent
from lazarus.agent.workers import Group
from lazarus.core import etcd as E
from lazarus.core.contract import ABSENT, CORRUPT
from lazarus.core.records import W_RUNNING, Keys, RoundRecord
from tests.agentports import BarePorts


class FakeEtcd:
    """The agent's writes, recorded; `current` is the round run/round holds."""

    def __init__(self, current: int = 2, away: bool = False):
        self.current, self.away = current, away
        self.writes: list[tuple[str, dict]] = []

    def txn(self, compare, success=()):
        if self.away:
            raise E.EtcdUnavailable("away")
        (cmp,) = compare
        if cmp.value != str(self.current).encode():
            return False
        self.writes += [(op.key.decode(), json.loads(op.value)) for op in success]
        return True


def agent_with(etcd: FakeEtcd, tmp_path) -> Agent:
    agent = Agent(etcd, Keys("/t/"), AgentConfig(node="a", nproc=2, role="active",
                                                 workdir=tmp_path, lease_ttl_s=5),
                  BarePorts(tmp_path, nproc=2))
    agent.workers.group = Group(round=2, procs={}, ranks={0: 4, 1: 5})
    agent.report = RoundReport(job_id="J", world_size=4)
    return agent


@pytest.fixture
def etcd():
    return FakeEtcd()


@pytest.fixture
def agent(etcd, tmp_path):
    return agent_with(etcd, tmp_path)


def step(rank: int, n: int, *, round_: int = 2, **kw) -> dict:
    return {"type": "step", "rank": rank, "round": round_, "step": n, "loss": 2.5,
            "step_time_s": 0.5, "tokens": 1000, **kw}


def test_the_lowest_local_rank_reports_the_nodes_loss_and_rate(agent):
    assert on_message(agent, step(5, 7, loss=9.0)) is None
    assert agent.report.step == {"step": 7, "loss": 0.0, "step_time_s": 0.0, "tokens_per_s": 0.0}
    on_message(agent, step(4, 6, window=[0, 10]))
    assert agent.report.step == {"step": 7, "loss": 2.5, "step_time_s": 0.5, "tokens_per_s": 2000.0,
                           "window": [0, 10]}
    assert agent.throughput.summary()  # both ranks' samples went to the tracker


def test_a_non_finite_step_time_is_reported_as_zero(agent):
    on_message(agent, step(4, 1, step_time_s=float("inf")))
    assert (agent.report.step["step_time_s"], agent.report.step["tokens_per_s"]) == (0.0, 0.0)


STALE = {
    "step": step(4, 9, round_=1),
    "joined": {"type": "joined", "rank": 4, "round": 1},
    "refused": {"type": "refused", "rank": 4, "round": 1, "reason": "no"},
    "restore_failed": {"type": "restore_failed", "round": 1, "kind": CORRUPT},
    "progress": {"type": "progress", "rank": 4, "round": 1, "step": 3, "phase": "checkpoint",
                 "seq": 1, "since": 1.0},
}


@pytest.mark.parametrize("kind", list(STALE))
def test_a_stale_rounds_message_changes_nothing(agent, kind):
    before = (dict(agent.report.step), set(agent.report.joined), agent.report.refused, agent.report.restore_failed,
              dict(agent.report.long_phase))
    assert on_message(agent, STALE[kind]) is None
    assert before == (agent.report.step, agent.report.joined, agent.report.refused, agent.report.restore_failed,
                      agent.report.long_phase)
    assert agent.hangs.long_phase_since() is None


@pytest.mark.parametrize("msg", [{"type": "bogus"}, {"type": ["step"]}, {"type": None}, {}])
def test_an_unknown_message_is_ignored(agent, msg):
    assert on_message(agent, msg) is None
    assert agent.report.step["step"] == 0


def test_the_rounds_first_step_wakes_the_agent_to_publish_the_others_do_not(agent):
    on_message(agent, step(4, 1))
    assert agent.wake.is_set()   # "running" is written now, not at the next tick
    agent.wake.clear()
    on_message(agent, step(5, 1))
    on_message(agent, step(4, 2))
    assert not agent.wake.is_set()


def test_spikes_come_from_global_rank_0_alone_and_are_bounded(agent):
    on_message(agent, step(4, 2))
    agent.wake.clear()  # the round's first step wakes the agent (the test above)
    on_message(agent, step(4, 3, spike={"window": [0, 1], "loss": 50.0, "reason": "x"}))
    assert agent.report.spikes == [] and not agent.wake.is_set()
    agent.workers.group = Group(round=2, procs={}, ranks={0: 0, 1: 1})
    for n in range(MAX_SPIKES + 3):
        on_message(agent, step(0, n, spike={"window": [n, n], "loss": 50.0, "reason": "x"}))
    assert len(agent.report.spikes) == MAX_SPIKES and agent.report.spikes[-1]["step"] == MAX_SPIKES + 2
    assert agent.wake.is_set()


def test_a_rank_entering_and_leaving_a_checkpoint_is_published_at_once(agent):
    progress = {"type": "progress", "rank": 4, "round": 2, "step": 3, "seq": 1}
    on_message(agent, {**progress, "phase": "checkpoint", "since": 1.0})
    assert agent.report.long_phase["since"] > 0 and agent.report.long_phase["allowance_s"] > 0
    assert agent.wake.is_set()
    agent.wake.clear()
    on_message(agent, {**progress, "step": 4, "phase": "forward", "since": 2.0})
    assert agent.report.long_phase["since"] == 0.0 and agent.report.long_phase["until"] > 0
    assert agent.wake.is_set()


def test_joined_refused_and_restore_failures_of_the_round_are_kept(agent):
    on_message(agent, {"type": "joined", "rank": 4, "round": 2})
    on_message(agent, {"type": "refused", "rank": 4, "round": 2, "reason": "r" * 600})
    on_message(agent, {"type": "restore_failed", "round": 2, "kind": ABSENT,
                       "checkpoint": "/c/5", "reason": "gone"})
    on_message(agent, {"type": "restore_failed", "round": 2, "kind": CORRUPT,
                       "checkpoint": "/c/5", "reason": "bad hash"})
    on_message(agent, {"type": "restore_failed", "round": 2, "kind": ABSENT,
                       "checkpoint": "/c/5", "reason": "gone again"})
    assert agent.report.joined == {4} and agent.report.refused == "r" * 500
    assert agent.report.restore_failed == {"checkpoint": "/c/5", "kind": CORRUPT,
                                     "reason": "bad hash"}


@pytest.mark.parametrize("round_, away, ok", [(2, False, True), (1, False, False),
                                              ("2", False, False), (2, True, False)])
def test_may_commit_is_fenced_on_the_round_in_etcd(etcd, agent, round_, away, ok):
    etcd.away = away
    assert on_message(agent, {"type": "may_commit", "round": round_}) == {
        "type": "may_commit", "ok": ok}


def test_a_commit_of_the_current_round_is_claimed_and_a_stale_one_is_not(etcd, agent):
    keys = Keys("/t/")
    on_message(agent, {"type": "committed", "rank": 0, "round": 1, "step": 10, "path": "/c/10"})
    on_message(agent, {"type": "committed", "rank": 0, "round": 2, "step": 12, "path": "/c/12"})
    on_message(agent, {"type": "committed", "rank": 0, "round": 2})  # malformed: dropped
    ((key, value),) = etcd.writes
    assert key == keys.claim_key(12)
    assert (value["step"], value["path"], value["round"], value["job_id"]) == (
        12, "/c/12", 2, "J")


def test_a_checkpoint_failure_is_an_event_fenced_on_the_round(etcd, agent):
    on_message(agent, {"type": "checkpoint_failed", "round": 1, "step": 3, "error": "full"})
    on_message(agent, {"type": "checkpoint_failed", "round": 2, "step": 4, "error": "full"})
    ((key, value),) = etcd.writes
    assert key.startswith(Keys("/t/").events) and value["kind"] == "checkpoint_failed"
    assert value["fields"] == {"step": 4, "error": "full", "reported_by": "a"}


def test_a_checkpoint_request_goes_to_the_ranks_once_per_new_id(agent):
    def kv(value):
        return SimpleNamespace(value=value) if value is not None else None

    for value in (b"old", b"old", b"new", b"new", None, None):
        pass_on_checkpoint_request(agent, kv(value))
    # the request the agent found at start is not its own; "new", then its deletion, are
    assert agent.channel.sent == [{"type": "checkpoint_requested"}] * 2


def test_a_survivor_is_recorded_only_for_its_own_process_rank_and_round(agent):
    agent.workers.group.procs = {0: SimpleNamespace(pid=100), 1: SimpleNamespace(pid=101)}
    for bad in ({"type": "survivor", "rank": 4, "round": 1, "pid": 100},    # a stale round
                {"type": "survivor", "rank": 4, "round": 2, "pid": 999},    # not our rank's
                {"type": "survivor", "rank": 5, "round": 2, "pid": 100},    # another's rank
                {"type": "survivor", "rank": "4", "round": 2, "pid": "100"},
                {"type": "survivor"}):
        assert on_message(agent, bad) is None
    assert agent.workers.group.survivors == set()
    on_message(agent, {"type": "survivor", "rank": 5, "round": 2, "pid": 101, "step": 9})
    assert agent.workers.group.survivors == {1}


class Running:
    """A rank's process that has not exited (carry_on takes running ranks only)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> None:
        return None


def test_a_carried_group_hears_its_ranks_launch_round_and_reports_the_new_one(agent):
    """A replica round leaves this node's replica be (docs/replicas.md): the ranks, launched
    in round 2, go on into round 5; they still say round 2, and the node status says 5."""
    agent.workers.group = Group(round=2, procs={0: Running(100), 1: Running(101)},
                                ranks={0: 4, 1: 5})
    on_message(agent, step(4, 7))
    rec = RoundRecord(round=5, job_id="J", members=["a", "b", "c", "d"], nproc_per_node=2,
                      world_size=8, dp=2, tp=1, store_host="127.0.0.1", store_port=1,
                      replicas=2, replica_rounds=[2, 5], replica_epoch=2)
    rounds.act(agent, CarryOn(rec))
    g = agent.workers.group
    assert (g.round, g.rank_round, g.pids()) == (5, 2, [100, 101])
    on_message(agent, step(4, 8))                 # their launch round: heard
    on_message(agent, step(4, 99, round_=5))      # no rank of this node was launched in 5
    assert agent.report.step["step"] == 8          # not reset by the carry either
    status = nodestatus.build(agent)
    assert (status.round, status.step, status.workers) == (5, 8, W_RUNNING)
    assert nodestatus.state(agent)[1] == 5         # the relabel is a write due at once
    # a later fault elsewhere releases them under the round they know
    rounds.act(agent, ReleaseVictims(5))
    assert agent.channel.sent[-1] == {"type": "abort_groups", "round": 2}


def test_an_agent_adopting_carried_ranks_keeps_both_rounds(agent):
    agent.workers.group = None
    rounds.take_over(agent, Left(node="a", round=5, rank_round=2, job_id="J", world_size=8,
                                 lease=1, channel="x", checkpoint_dir=None, agent_pid=1,
                                 ranks=[LeftRank(local_rank=0, rank=4, pid=100, started=1.0)]))
    g = agent.workers.group
    assert (g.round, g.rank_round) == (5, 2)
    on_message(agent, step(4, 3))
    assert agent.report.step["step"] == 3
