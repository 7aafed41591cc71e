"""What `lazarus status` says of a script that reports no steps (level 0, docs/adopting.md):
the collectives its ranks issued ride on the node status the agent writes anyway, the daemon
derives their rate from two successive statuses, and the status line says "step unknown"
with what is known, never step 0 and a zero loss. With it: an idle active node is not called
a spare, and a recovery says which ranks started anew in a sentence."""

from __future__ import annotations

import time

from lazarus.agent import nodestatus
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.messages import on_message
from lazarus.agent.roundreport import RoundReport
from lazarus.agent.service import Agent
from lazarus.agent.workers import Group
from lazarus.core.etcd import KV
from lazarus.core.records import RUNNING, Keys, NodeRecord, NodeStatus, RoundRecord, RunStatus
from lazarus.daemon import health
from lazarus.daemon.decide import _anew_said
from lazarus.daemon.view import ViewBuilder
from lazarus.ops import client
from tests.agentports import BarePorts
from tests.unit.test_decide import job

KEYS = Keys("/t/")
SCRIPT = ["python", "train.py"]


# -- the agent: collectives carried, never a reason to write -----------------------------------
def _agent(tmp_path) -> Agent:
    agent = Agent(None, KEYS, AgentConfig(node="a", nproc=2, role="active", workdir=tmp_path,
                                          lease_ttl_s=5, status_period_s=15.0),
                  BarePorts(tmp_path))
    agent.workers.group = Group(round=2, procs={}, ranks={0: 0, 1: 1})
    agent.report = RoundReport(job_id="J", world_size=2)
    return agent


def _issued(agent: Agent, rank: int, seq: int, ago_s: float = 0.0) -> None:
    """What lazarus.trainer.collwatch sends for a rank that has issued `seq` collectives."""
    on_message(agent, {"type": "progress", "rank": rank, "round": 2, "step": 0, "seq": seq,
                       "phase": "collective", "since": time.monotonic() - ago_s})


def test_the_node_status_carries_the_collectives_every_rank_issued(tmp_path):
    agent = _agent(tmp_path)
    assert (nodestatus.build(agent).collectives, nodestatus.build(agent).collective_at) == (-1, 0.0)
    _issued(agent, 0, 120, ago_s=3.0)
    _issued(agent, 1, 118, ago_s=1.0)
    before = time.time()
    status = nodestatus.build(agent)
    # the least: rank 1 has not got to rank 0's 119th and 120th yet
    assert status.collectives == 118 and status.step == 0
    # the newest report's wall time: rank 1's, a second ago
    assert before - 1.5 < status.collective_at < before - 0.5
    assert NodeStatus.from_json(status.to_json()) == status


def test_collectives_ride_on_the_periods_write_and_never_make_one_at_once(tmp_path):
    agent = _agent(tmp_path)
    pub = agent.publisher
    _issued(agent, 0, 10)
    _issued(agent, 1, 10)
    now = time.time()
    state = nodestatus.state(agent)
    pub.wrote(state, 0, now, nodestatus.build(agent).collectives)
    _issued(agent, 0, 50)
    _issued(agent, 1, 50)
    # the step stays 0 (the script reports none): moving collectives make no write at once...
    assert not pub.due(now + 1, nodestatus.state(agent), 0, force=False)
    # ...and one once a period (15 s, stretched by up to 20%), as a moving step would
    assert pub.due(now + 15 * 1.2 + 0.1, nodestatus.state(agent), 0, force=False)
    pub.wrote(nodestatus.state(agent), 0, now + 18.1, nodestatus.build(agent).collectives)
    # collectives that stand still (a hang): no write for them
    assert not pub.due(now + 60, nodestatus.state(agent), 0, force=False)


# -- the daemon: the rate from two successive statuses ---------------------------------------
def _kv(key: str, value: bytes, lease: int = 5) -> KV:
    return KV(key=key, value=value, create_revision=1, mod_revision=1, version=1, lease=lease)


def _node(name: str, role: str = "active"):
    return KEYS.node_key(name), _kv(KEYS.node_key(name), NodeRecord(
        node=name, host="h", nproc=2, role=role).to_json())


def _status(name: str, collectives: int, at: float, *, round: int = 1, step: int = 0):
    return KEYS.nodestatus_key(name), _kv(KEYS.nodestatus_key(name), NodeStatus(
        node=name, round=round, workers="running", step=step, collectives=collectives,
        collective_at=at).to_json())


def test_the_daemon_derives_the_rate_from_two_successive_statuses():
    b = ViewBuilder(KEYS)
    b.apply([_node("a"), _status("a", 100, 1000.0)])
    assert b.build(1).collective_rate == {}  # one status: no rate yet
    b.apply([_status("a", 400, 1015.0)])
    assert b.build(2).collective_rate == {"a": 20.0}
    # a status written for another reason, the collectives standing still: the rate stays
    b.apply([_status("a", 400, 1015.0)])
    assert b.build(3).collective_rate == {"a": 20.0}
    # a new round counts from 0 again: no rate across rounds
    b.apply([_status("a", 5, 1020.0, round=2)])
    assert b.build(4).collective_rate == {}


def _level0_view(now: float, *, builtin: bool = False, steps: tuple[int, int] = (0, 0)):
    b = ViewBuilder(KEYS)
    b.apply([_node("a"), _node("b"), _node("c"), _node("s", "spare"),
             _status("a", 1000, now - 20), _status("b", 1010, now - 19),
             _status("a", 3000, now - 4, step=steps[0]), _status("b", 2980, now - 3, step=steps[1])])
    v = b.build(7)
    v.job = job() if builtin else job(command=SCRIPT)
    v.status = RunStatus(job_id="J", state=RUNNING, round=1, members=["a", "b"], since=now - 60)
    v.round = RoundRecord(round=1, job_id="J", members=["a", "b"], nproc_per_node=2,
                          world_size=4, dp=4, tp=1, store_host="h", store_port=1)
    return v


def test_run_health_of_a_level0_round_says_what_is_known():
    now = 5000.0
    h = health.run_health(_level0_view(now), now=now, served_by="d1")
    assert h.steps_unknown
    assert (h.ranks_joined, h.world_size) == (4, 4)
    assert h.collectives == 2980                       # the least node's
    assert h.collectives_per_s == 1970 / 16            # the slowest node's rate (b)
    assert h.last_collective_age_s == 3.0              # the newest report (b's)


def test_steps_are_known_from_the_builtin_trainer_or_a_level1_script():
    now = 5000.0
    assert not health.run_health(_level0_view(now, builtin=True), now=now,
                                 served_by="d1").steps_unknown
    assert not health.run_health(_level0_view(now, steps=(7, 7)), now=now,
                                 served_by="d1").steps_unknown


# -- what the operator reads -----------------------------------------------------------------
def test_status_of_a_level0_run_says_step_unknown_not_zeros(capsys):
    now = 5000.0
    h = health.run_health(_level0_view(now), now=now, served_by="d1")
    client.render_status(h, now)
    out = capsys.readouterr().out
    assert "step        unknown (the script does not report steps)  round 1  4/4 ranks joined" \
           "  2,980 collectives  123.1/s  last 3 s ago" in out, out
    assert "loss" not in out and "tok/s" not in out


def test_status_before_any_collective_says_so(capsys):
    now = 5000.0
    v = _level0_view(now)
    v.node_status = {}
    client.render_status(health.run_health(v, now=now, served_by="d1"), now)
    out = capsys.readouterr().out
    assert "unknown (the script does not report steps)  round 1  0/4 ranks joined  no " \
           "collective reported yet" in out, out


def test_an_idle_active_node_is_idle_and_a_spare_is_a_spare():
    now = 5000.0
    h = health.run_health(_level0_view(now), now=now, served_by="d1")
    assert dict(h.nodes_by_state) == {"running": 2, "idle": 1, "spare": 1}
    states = {n.node: n.state for n in health.list_nodes(_level0_view(now), now=now)}
    assert states == {"a": "running", "b": "running", "c": "idle", "s": "spare"}


def test_ranks_started_anew_are_said_in_a_sentence():
    assert _anew_said({"failed first": [1, 0]}) == "ranks 0 and 1 started anew (failed first)"
    assert _anew_said({"failed first": [3], "new on this node": [4, 5, 6, 7, 8]}) == (
        "rank 3 started anew (failed first); 5 ranks started anew (new on this node)")
    assert _anew_said({"exited with the round": [0, 1, 2]}) == (
        "ranks 0, 1 and 2 started anew (exited with the round)")
