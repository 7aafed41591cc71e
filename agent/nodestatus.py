"""The node status the agent writes (NodeStatus, under its lease): what its ranks do and
report, the node's health, a hang, a preflight's result, tier-0 holdings.

`state` is the cheap part a pass compares to decide whether a write is due
(lazarus.agent.decide.status_due); the whole status, with its throughput summary, is built
only to be written.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lazarus.agent.workers import Group, rank_log, tail
from lazarus.core import etcd as E
from lazarus.core.records import (OUTPUT_TAIL_BYTES, W_FAILED, W_IDLE, W_RUNNING, W_STARTING,
                                  W_SUCCEEDED, NodeStatus)

if TYPE_CHECKING:
    from lazarus.agent.service import Agent

# A status period is stretched by up to this fraction at random each time (see
# Agent._init_state).
PERIOD_JITTER = 0.2


def workers_state(agent: Agent, step: int) -> str:
    g = agent.workers.group
    if g is None:
        return W_IDLE
    if g.failed:
        return W_FAILED
    if g.succeeded:
        return W_SUCCEEDED
    # "running" once a step was reported: a round is joined when training really goes. A
    # script that reports no steps (level 0): once each of its ranks made its process group
    # (lazarus.trainer.collwatch).
    with agent._lock:
        joined = bool(g.ranks) and set(g.ranks.values()) <= agent._joined
    return W_RUNNING if step > 0 or joined else W_STARTING


def state(agent: Agent) -> tuple:
    """What a status write is due for at once when it changes; cheap, asked every pass."""
    g = agent.workers.group
    with agent._lock:
        step, spikes = agent._step["step"], len(agent._spikes)
        long_phase = bool(agent._long_phase.get("since"))
        refused = bool(agent._refused)
        restore_failed = agent._restore_failed.get("kind")
    health = agent.health.poll() if agent.monitors else {}
    checked = agent.preflight.result if agent.preflight is not None else {}
    return (workers_state(agent, step), g.round if g else 0,
            g.failed_rank() if g else None, spikes, health.get("state"),
            agent._hang is not None, long_phase, refused, checked.get("at"),
            restore_failed)


def build(agent: Agent) -> NodeStatus:
    g = agent.workers.group
    with agent._lock:
        st = dict(agent._step)
        spikes = list(agent._spikes)
        throughput = agent.throughput.summary()
        long_phase = dict(agent._long_phase)
        refused = agent._refused
        restore_failed = dict(agent._restore_failed)
    return NodeStatus(
        node=agent.node, round=g.round if g else 0, workers=workers_state(agent, st["step"]),
        exit_codes={str(k): v for k, v in g.exit_codes.items()} if g else {},
        failed_rank=g.failed_rank() if g else None, step=st["step"], loss=st["loss"],
        step_time_s=st["step_time_s"], tokens_per_s=st["tokens_per_s"],
        pids=g.pids() if g else [], parked=len(agent.workers.parked),
        updated_at=time.time(), fault_at=g.fault_at if g else 0.0, spikes=spikes,
        window=st.get("window") or [],
        health=agent.health.poll() if agent.monitors else {}, hang=agent._hang,
        throughput=throughput, long_phase=long_phase, refused=refused,
        preflight=dict(agent.preflight.result) if agent.preflight is not None else {},
        tier0=agent.tier0.holdings(agent._job_id, agent._world_size)
        if agent.tier0 is not None else {},
        restore_failed=restore_failed, output_tail=_output_tail(agent, g),
        in_place=sorted(g.ranks[lr] for lr in g.kept) if g else [],
        anew=_anew(g))


def _anew(g: Group | None) -> dict[str, list[int]]:
    by_why: dict[str, list[int]] = {}
    for lr, why in (g.anew.items() if g else ()):
        by_why.setdefault(why, []).append(g.ranks[lr])
    return {why: sorted(ranks) for why, ranks in by_why.items()}


def _output_tail(agent: Agent, g: Group | None) -> str:
    """The failed rank's last lines, read once per failed round."""
    if g is None or g.first_failure is None:
        return ""
    if agent._tail[0] != g.round:
        rank = g.ranks[g.first_failure]
        agent._tail = (g.round, tail(rank_log(agent.workers.log_dir, g.round, rank),
                                     OUTPUT_TAIL_BYTES))
    return agent._tail[1]


def write(agent: Agent, state_: tuple, now: float) -> bool:
    """Write the status under the agent's lease; False when the lease is lost (register()
    starts a new session on the next pass)."""
    status = agent.node_status()
    assert agent.session is not None
    try:
        agent.etcd.put(agent.keys.nodestatus_key(agent.node), status.to_json(),
                       lease=agent.session.lease)
    except E.LeaseLost:
        agent.session.mark_lost()
        return False
    agent._published_state, agent._published_step, agent._published_at = (
        state_, status.step, now)
    agent._next_period_s = agent.status_period_s * (
        1 + PERIOD_JITTER * agent._period_jitter.random())
    return True
