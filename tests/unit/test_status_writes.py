"""What makes an agent write its node status at once (lazarus.agent.nodestatus.state): a
checkpoint its ranks pass through quickly costs no write (it was two per node per save, most
of a small cluster's writes: docs/architecture.md, "Write budget"); one that lasts is written
when it shows and when it ends, and no status written meanwhile says a save goes on that
ended unseen."""

from __future__ import annotations

import time

from lazarus.agent import nodestatus
from lazarus.agent.agentconfig import AgentConfig
from lazarus.agent.messages import on_message
from lazarus.agent.roundreport import RoundReport
from lazarus.agent.service import Agent
from lazarus.agent.workers import Group
from lazarus.core.records import Keys
from tests.agentports import BarePorts


def _agent(tmp_path) -> Agent:
    agent = Agent(None, Keys("/t/"), AgentConfig(node="a", nproc=1, role="active",
                                                 workdir=tmp_path, lease_ttl_s=5),
                  BarePorts(tmp_path))
    agent.workers.group = Group(round=2, procs={}, ranks={0: 0})
    agent.report = RoundReport(job_id="J", world_size=2)
    return agent


def _enter(agent: Agent, phase: str, step: int, ago_s: float) -> None:
    """Rank 0 entered `phase` of `step` `ago_s` seconds ago (its record's monotonic time)."""
    on_message(agent, {"type": "progress", "rank": 0, "round": 2, "step": step, "seq": step,
                       "phase": phase, "since": time.monotonic() - ago_s})


def test_a_short_save_costs_no_status_write_and_a_long_one_is_written_twice(tmp_path):
    agent = _agent(tmp_path)
    floor = agent.hangs.config.floor_s
    _enter(agent, "forward", 5, 0.0)
    written = nodestatus.state(agent)
    pub = nodestatus.Publisher("a", period_s=15.0)
    pub.wrote(written, 5, time.time())

    # a save under way for a moment: nothing due, and a status written anyway (its period)
    # does not say it, so nothing holds the daemon once it ended unseen
    _enter(agent, "checkpoint", 5, 0.0)
    assert agent.report.long_phase["since"] > 0  # the agent knows
    assert not pub.due(time.time(), nodestatus.state(agent), 5, force=False)
    assert nodestatus.build(agent).long_phase["since"] == 0.0
    _enter(agent, "forward", 6, 0.0)
    assert not pub.due(time.time(), nodestatus.state(agent), 6, force=False)

    # a save that has lasted (a quarter of the hang floor): written at once, with its start
    _enter(agent, "checkpoint", 6, floor)
    shown = nodestatus.state(agent)
    assert pub.due(time.time(), shown, 6, force=False)
    status = nodestatus.build(agent)
    assert status.long_phase["since"] == agent.report.long_phase["since"] > 0
    pub.wrote(shown, 6, time.time())
    # ... and its end, at once too
    _enter(agent, "forward", 7, 0.0)
    assert pub.due(time.time(), nodestatus.state(agent), 7, force=False)
    assert nodestatus.build(agent).long_phase["until"] > 0
