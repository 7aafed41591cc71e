"""The daemon's loss-spike policy, from a job file's [policy] table.

    [policy]
    max_spikes = 3          # this many skipped (spiking) steps ...
    window_steps = 50       # ... within this many steps -> roll back
    good_after_steps = 10   # a checkpoint is good once this many steps after it were clean
    lr_scale = 1.0          # after a rollback, multiply the LR by this ...
    lr_scale_steps = 0      # ... for this many steps (0: not at all)

One spike is the trainer guard's business (it skips that batch). Spikes that repeat mean the
model or the data went bad: the run goes back to the last good checkpoint -- committed, and
with no spike in the `good_after_steps` steps after it, so a checkpoint taken just before a
spike is never the one restored -- and skips the data window the spikes came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lazarus.errors import UserError


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
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - names)
        if unknown:
            raise UserError(f"{source}: unknown key(s) in [policy]: {unknown}")
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
