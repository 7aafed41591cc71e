"""The node status the agent writes (NodeStatus, under its lease): what its ranks do and
report, the node's health, a hang, a preflight's result, tier-0 holdings.

`state` is the cheap part a pass compares to decide whether a write is due
(lazarus.agent.decide.status_due); the whole status, with its throughput summary, is built
only to be written.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from lazarus.agent import decide
from lazarus.agent.workers import Group, rank_log, tail
from lazarus.core import etcd as E
from lazarus.core.records import (OUTPUT_TAIL_BYTES, W_FAILED, W_IDLE, W_RUNNING, W_STARTING,
                                  W_SUCCEEDED, NodeStatus)

if TYPE_CHECKING:
    from lazarus.agent.service import Agent

# A status period is stretched by up to this fraction at random each time (see `Publisher`).
PERIOD_JITTER = 0.2
# A checkpoint or eval under way is published once it has lasted this part of the hang floor.
# The daemon reads it only to hold the hang reports of other nodes whose ranks wait for it,
# and those come after a whole allowance (the floor at least): a save shorter than this
# stalls nobody long enough to matter, and costs no write (it was two per node per save:
# docs/architecture.md, "Write budget").
LONG_PHASE_SHOWN = 0.25


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
        joined = bool(g.ranks) and set(g.ranks.values()) <= agent.report.joined
    return W_RUNNING if step > 0 or joined else W_STARTING


def state(agent: Agent) -> tuple:
    """What a status write is due for at once when it changes; cheap, asked every pass."""
    g = agent.workers.group
    with agent._lock:
        r = agent.report
        step, spikes = r.step["step"], len(r.spikes)
        long_phase = bool(_long_phase(agent, r.long_phase, time.time()).get("since"))
        refused = bool(r.refused)
        restore_failed = r.restore_failed.get("kind")
        hang = r.hang is not None
        # Not a reason to write (a level-0 script issues them all the time): it rides on
        # the period's write, which moving collectives make due as a moving step does.
        agent.publisher.collectives = collectives(agent)[0]
    health = agent.health.poll() if agent.cfg.monitors else {}
    checked = agent.preflight.result if agent.preflight is not None else {}
    return (workers_state(agent, step), g.round if g else 0,
            g.failed_rank() if g else None, spikes, health.get("state"),
            hang, long_phase, refused, checked.get("at"),
            restore_failed, tuple(sorted(agent.workers.unkillable)))


def build(agent: Agent) -> NodeStatus:
    g = agent.workers.group
    with agent._lock:
        r = agent.report
        st = dict(r.step)
        spikes = list(r.spikes)
        throughput = agent.throughput.summary()
        long_phase = _long_phase(agent, r.long_phase, time.time())
        refused = r.refused
        restore_failed = dict(r.restore_failed)
        hang, job_id, world_size = r.hang, r.job_id, r.world_size
        issued, issued_at = collectives(agent)
    return NodeStatus(
        node=agent.cfg.node, round=g.round if g else 0, workers=workers_state(agent, st["step"]),
        exit_codes={str(k): v for k, v in g.exit_codes.items()} if g else {},
        failed_rank=g.failed_rank() if g else None, step=st["step"], loss=st["loss"],
        step_time_s=st["step_time_s"], tokens_per_s=st["tokens_per_s"],
        pids=g.pids() if g else [], parked=len(agent.workers.parked),
        updated_at=time.time(), fault_at=g.fault_at if g else 0.0, spikes=spikes,
        window=st.get("window") or [],
        health=agent.health.poll() if agent.cfg.monitors else {}, hang=hang,
        throughput=throughput, long_phase=long_phase, refused=refused,
        preflight=dict(agent.preflight.result) if agent.preflight is not None else {},
        tier0=agent.tier0.holdings(job_id, world_size)
        if agent.tier0 is not None else {},
        restore_failed=restore_failed, output_tail=_output_tail(agent, g),
        in_place=sorted(g.ranks[lr] for lr in g.kept) if g else [],
        anew=_anew(g), collectives=issued, collective_at=issued_at,
        unkillable=agent.workers.set_aside())


def collectives(agent: Agent) -> tuple[int, float]:
    """(the collectives every local rank has issued this round, wall time of the newest
    report of one); (-1, 0.0) before any. Read from the hang detector, which holds each
    rank's latest progress (lazarus.trainer.collwatch for a level-0 script); lock held."""
    latest = agent.hangs.latest()
    if not latest:
        return -1, 0.0
    newest = max(p.since for p in latest)
    # `since` is time.monotonic() of the host, which every process on it shares
    return min(p.seq for p in latest), time.time() - max(0.0, time.monotonic() - newest)


def _long_phase(agent: Agent, phase: dict, now: float) -> dict:
    """The long phase as the status says it: one under way only once it has lasted
    LONG_PHASE_SHOWN of the hang floor, so that a status written meanwhile never holds the
    daemon with a save that ended unseen."""
    since = phase.get("since")
    if since and now - since < LONG_PHASE_SHOWN * agent.hangs.config.floor_s:
        return {"since": 0.0, "until": phase.get("until", 0.0)}
    return dict(phase)


def _anew(g: Group | None) -> dict[str, list[int]]:
    by_why: dict[str, list[int]] = {}
    for lr, why in (g.anew.items() if g else ()):
        by_why.setdefault(why, []).append(g.ranks[lr])
    return {why: sorted(ranks) for why, ranks in by_why.items()}


def _output_tail(agent: Agent, g: Group | None) -> str:
    """The failed rank's last lines, read once per failed round."""
    if g is None or g.first_failure is None:
        return ""
    report = agent.report
    if report.tail is None:
        rank = g.ranks[g.first_failure]
        report.tail = tail(rank_log(agent.workers.log_dir, g.rank_round, rank),
                           OUTPUT_TAIL_BYTES)
    return report.tail


class Publisher:
    """When the node status was last written, with what: a write is due at once on a change
    of `state`, else once a jittered period while the step moves (lazarus.agent.decide
    .status_due). Each period is stretched at random (PERIOD_JITTER): a round starts every
    agent's period at once, and without it they stay in step and write in bursts of the
    whole fleet."""

    def __init__(self, node: str, period_s: float):
        self.period_s = period_s
        self.state: tuple | None = None   # None: nothing written under the current lease
        self.step = -1
        # Collectives of a script that reports no steps move as a step does: the latest
        # seen (set by `state`, asked every pass) and the one written.
        self.collectives = -1
        self.written_collectives = -1
        self.at = 0.0
        self._jitter = random.Random(node)
        self.next_period_s = period_s

    def due(self, now: float, state: tuple, step: int, *, force: bool) -> bool:
        return decide.status_due(now, state, (step, self.collectives),
                                 published_state=self.state,
                                 published_step=(self.step, self.written_collectives),
                                 published_at=self.at,
                                 period_s=self.next_period_s, force=force)

    def wrote(self, state: tuple, step: int, now: float, collectives: int = -1) -> None:
        self.state, self.step, self.at = state, step, now
        self.written_collectives = collectives
        self.next_period_s = self.period_s * (1 + PERIOD_JITTER * self._jitter.random())


def write(agent: Agent, state_: tuple, now: float) -> bool:
    """Write the status under the agent's lease; False when the lease is lost (register()
    starts a new session on the next pass)."""
    status = agent.node_status()
    assert agent.session is not None
    try:
        agent.etcd.put(agent.keys.nodestatus_key(agent.cfg.node), status.to_json(),
                       lease=agent.session.lease)
    except E.LeaseLost:
        agent.session.mark_lost()
        return False
    agent.publisher.wrote(state_, status.step, now, status.collectives)
    return True
