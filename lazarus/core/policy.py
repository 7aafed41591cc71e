"""The daemon's policies, from a job file's [policy] table: loss spikes and stragglers.

    [policy]
    max_spikes = 3          # this many skipped (spiking) steps ...
    window_steps = 50       # ... within this many steps -> roll back
    good_after_steps = 10   # a checkpoint is good once this many steps after it were clean
    lr_scale = 1.0          # after a rollback, multiply the LR by this ...
    lr_scale_steps = 0      # ... for this many steps (0: not at all)
    straggler_margin = 1.2  # a rank whose own compute time is this many times its peers' ...
    straggler_steps = 14    # ... in this many of its last 20 samples (steps pooled to >= 0.25 s)
    swap_cost_s = 60.0      # what swapping a node costs (checkpoint, rendezvous, restore)

One spike is the trainer guard's business (it skips that batch). Spikes that repeat mean the
model or the data went bad: the run goes back to the last good checkpoint -- committed, and
with no spike in the `good_after_steps` steps after it, so a checkpoint taken just before a
spike is never the one restored -- and skips the data window the spikes came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lazarus.core.errors import UserError


@dataclass(kw_only=True, slots=True, frozen=True)
class SpikePolicy:
    max_spikes: int = 3
    window_steps: int = 50
    good_after_steps: int = 10
    lr_scale: float = 1.0
    lr_scale_steps: int = 0

    @classmethod
    def from_dict(cls, table: dict, *, source: str) -> "SpikePolicy":
        if not isinstance(table, dict):
            raise UserError(f"{source}: [policy] must be a table")
        table = _own_keys(cls, table, source)
        for key in ("max_spikes", "window_steps", "good_after_steps", "lr_scale_steps"):
            value = table.get(key, getattr(cls(), key))
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"{source}: [policy] {key} must be a non-negative integer, "
                                f"got {value!r}")
        if table.get("max_spikes", 3) < 1:
            raise UserError(f"{source}: [policy] max_spikes must be at least 1")
        if table.get("window_steps", 50) < 1:
            raise UserError(f"{source}: [policy] window_steps must be at least 1")
        scale = table.get("lr_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise UserError(f"{source}: [policy] lr_scale must be in (0, 1], got {scale!r}")
        return cls(**{**table, "lr_scale": float(scale)})

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class StragglerPolicy:
    straggler_margin: float = 1.2
    straggler_steps: int = 14
    swap_cost_s: float = 60.0

    @classmethod
    def from_dict(cls, table: dict, *, source: str) -> "StragglerPolicy":
        table = _own_keys(cls, table, source)
        margin = table.get("straggler_margin", cls().straggler_margin)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 1:
            raise UserError(f"{source}: [policy] straggler_margin must be a number above 1 "
                            f"(a factor over the peers' median), got {margin!r}")
        steps = table.get("straggler_steps", cls().straggler_steps)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= WINDOW:
            raise UserError(f"{source}: [policy] straggler_steps must be an integer in "
                            f"[1, {WINDOW}] (out of the last {WINDOW} steps), got {steps!r}")
        cost = table.get("swap_cost_s", cls().swap_cost_s)
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost >= 0:
            raise UserError(f"{source}: [policy] swap_cost_s must be a non-negative number of "
                            f"seconds, got {cost!r}")
        return cls(straggler_margin=float(margin), straggler_steps=steps,
                   swap_cost_s=float(cost))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# The straggler test looks at each rank's last WINDOW samples (the agents keep that many;
# lazarus.core.throughput pools steps shorter than its sample_s into one sample).
WINDOW = 20
_POLICIES = (SpikePolicy, StragglerPolicy)


def _own_keys(cls, table, source: str) -> dict:
    """The keys of `table` that belong to `cls`, after refusing keys no policy knows."""
    if not isinstance(table, dict):
        raise UserError(f"{source}: [policy] must be a table")
    known = {f.name for p in _POLICIES for f in dataclasses.fields(p)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise UserError(f"{source}: unknown key(s) in [policy]: {unknown} "
                        f"(known: {', '.join(sorted(known))})")
    mine = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in table.items() if k in mine}


def parse(table, *, source: str) -> dict:
    """Validate a whole [policy] table; the normalized table with every default filled in."""
    return {**SpikePolicy.from_dict(table, source=source).as_dict(),
            **StragglerPolicy.from_dict(table, source=source).as_dict()}
