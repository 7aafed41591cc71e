"""The checkpoint stall record: what one checkpoint cost the training loop, in metrics.jsonl.

The trainer's metrics file (`[train] metrics`, rank 0) holds one JSON line per optimizer step
and, among them, one line per checkpoint::

    {"kind": "checkpoint", "step": 20, "tier": "storage", "blocked_s": 0.041, "durable_s": 0.63,
     "ranks": 8}

- `tier`: "storage" is tier 1 (DCP on shared storage); "memory" is tier 0 (a snapshot in host
  memory, replicated to a peer), which writes the same record.
- `blocked_s`: wall time the save held the training loop (waiting for the previous save,
  staging or snapshotting the state, and in a synchronous save the whole write and commit).
  A step's `step_time_s` ends before the checkpoint, so it never includes this.
- `durable_s`: from the start of the save until it was committed (tier 1: the manifest is
  durable on storage; tier 0: the agent says the copy is on its ring peer, or on the node
  itself without a peer); null when it never was (the storage refused it, a stale round was
  fenced off, a newer snapshot overtook it on its way to the peer).
- `ranks`: the world size that saved it (one rank per GPU: nodes x ranks per node), which
  `lazarus goodput` scales the failure rate by; may be absent.

A line is emitted when its save has finished, so it may come a few steps after the step it
names. Step lines carry no `kind`: readers that want steps only use `is_step`.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

KIND = "checkpoint"
TIERS = ("storage", "memory")


class StallError(ValueError):
    """A checkpoint line that is not a stall record."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointStall:
    step: int
    tier: str
    blocked_s: float
    durable_s: float | None
    ranks: int | None = None

    def __post_init__(self):
        if self.tier not in TIERS:
            raise StallError(f"tier {self.tier!r} is not one of {', '.join(TIERS)}")
        for name in ("blocked_s", "durable_s"):
            value = getattr(self, name)
            if value is None and name == "durable_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise StallError(f"{name} must be a finite number >= 0, not {value!r}")
        if self.ranks is not None and (isinstance(self.ranks, bool)
                                       or not isinstance(self.ranks, int) or self.ranks < 1):
            raise StallError(f"ranks must be a positive integer, not {self.ranks!r}")

    def to_row(self) -> dict:
        return {"kind": KIND, "step": self.step, "tier": self.tier,
                "blocked_s": round(self.blocked_s, 6),
                "durable_s": None if self.durable_s is None else round(self.durable_s, 6),
                **({} if self.ranks is None else {"ranks": self.ranks})}

    @classmethod
    def from_row(cls, row: dict) -> CheckpointStall:
        """The record of a metrics line of kind "checkpoint"; StallError if it is not one."""
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise StallError(f"step must be an integer, not {step!r}")
        return cls(step=step, tier=row.get("tier"), blocked_s=row.get("blocked_s"),
                   durable_s=row.get("durable_s"), ranks=row.get("ranks"))


def is_step(row: dict) -> bool:
    """Whether a metrics line is a step's (not a checkpoint's, or another record's)."""
    return "kind" not in row


def is_stall(row: dict) -> bool:
    """Whether a metrics line is a checkpoint's stall record (a round's start line is not)."""
    return row.get("kind") == KIND


@dataclass(frozen=True, kw_only=True, slots=True)
class TierStalls:
    """One tier's checkpoints in a run. The durable figures cover the committed ones only
    (None if none was); `every` is the usual step gap between checkpoints (None with fewer
    than two)."""
    tier: str
    count: int
    committed: int
    blocked_median_s: float
    blocked_max_s: float
    blocked_total_s: float
    durable_median_s: float | None
    durable_max_s: float | None
    every: int | None


def by_tier(stalls: list[CheckpointStall]) -> dict[str, TierStalls]:
    """The stall records of a run summarised per tier, in TIERS order."""
    out = {}
    for tier in TIERS:
        mine = [s for s in stalls if s.tier == tier]
        if not mine:
            continue
        blocked = [s.blocked_s for s in mine]
        durable = [s.durable_s for s in mine if s.durable_s is not None]
        # A restore sends the steps back, and the run's last step is checkpointed whatever the
        # interval: the most common forward gap is the interval.
        gaps = [b.step - a.step for a, b in itertools.pairwise(mine) if b.step > a.step]
        out[tier] = TierStalls(
            tier=tier, count=len(mine), committed=len(durable),
            blocked_median_s=statistics.median(blocked), blocked_max_s=max(blocked),
            blocked_total_s=sum(blocked),
            durable_median_s=statistics.median(durable) if durable else None,
            durable_max_s=max(durable) if durable else None,
            every=max(statistics.multimode(gaps)) if gaps else None)
    return out
