"""What this node's ranks of the current round told the agent: the facts of one round, which
the node status carries (lazarus.agent.nodestatus). A launch, or the adoption of a previous
agent's ranks, replaces the whole value at once (lazarus.agent.rounds): nothing of one round
can leak into the next. The channel's thread fills it in (lazarus.agent.messages), under the
agent's lock; the loop reads it under the same lock."""

from __future__ import annotations

from dataclasses import dataclass, field

from lazarus.agent.msglimits import MessageLimits


def _no_step() -> dict:
    return {"step": 0, "loss": 0.0, "step_time_s": 0.0, "tokens_per_s": 0.0}


@dataclass(eq=False)
class RoundReport:
    job_id: str = ""                      # the job of the round
    world_size: int = 1
    checkpoint_dir: str | None = None     # the job's, watched by the host monitor
    # the last step of the node's lowest rank: step, loss, step time, tokens/s, data window
    step: dict = field(default_factory=_no_step)
    spikes: list[dict] = field(default_factory=list)   # skipped steps, newest last
    long_phase: dict = field(default_factory=lambda: {"since": 0.0, "until": 0.0})
    hang: dict | None = None              # this round's hang report, once made
    refused: str = ""                     # why a rank refused the job
    restore_failed: dict = field(default_factory=dict)  # what its ranks found wrong
    joined: set = field(default_factory=set)  # ranks that made their process group
    tail: str | None = None               # the failed rank's last output, once read
    # ranks adopted from a previous agent whose node status is not read back yet
    # (lazarus.agent.rounds.resume_status)
    adopted: bool = False
    # how much more of each kind of message the ranks may make the agent write this round
    limits: MessageLimits = field(default_factory=MessageLimits)
