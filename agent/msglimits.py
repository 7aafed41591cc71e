"""How much a node's ranks may make their agent write: the job's own code speaks on the worker
channel, and what it says turns into etcd writes (checkpoint claims, events, status changes).
Each kind has a token bucket per round; what goes over it is dropped, counted, and said once
(docs/security.md, "The job's own code"). Fields a rank sends are cut to a bound before they
reach a record (`text`, `cursors`).

The buckets are generous for a job that works as meant -- a checkpoint commits every few
seconds at the most, a save fails once per save, a checkpoint or eval phase starts and ends
once per step at the most -- and keep a flood at a few writes a second per node, where
unbounded it filled etcd's quota in seconds (700 MB from one rank in 15 s).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# kind -> (burst, per second)
LIMITS = {
    "claim": (16, 2.0),          # checkpoint commits claimed for the daemon
    "event": (4, 1 / 30),        # checkpoint_failed events
    "phase": (8, 0.5),           # a long phase entered or left: an immediate status write
}
MAX_TEXT = 500                   # an error or a reason in a record
MAX_PATH = 4096                  # a checkpoint's path (the daemon refuses longer ones)


class Bucket:
    """`burst` at once, then `per_s` a second."""

    def __init__(self, burst: int, per_s: float, clock: Callable[[], float] = time.monotonic):
        self.burst, self.per_s, self._clock = burst, per_s, clock
        self._tokens = float(burst)
        self._at = clock()
        self.dropped = 0

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        self.dropped += 1
        return False


class MessageLimits:
    """The buckets of one round's messages on one node."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.buckets = {kind: Bucket(b, r, clock) for kind, (b, r) in LIMITS.items()}

    def take(self, kind: str) -> tuple[bool, bool]:
        """(allowed, first drop): the second is True once per kind and round, when it is
        time to say that messages of that kind are dropped."""
        bucket = self.buckets[kind]
        if bucket.take():
            return True, False
        return False, bucket.dropped == 1

    def dropped(self) -> dict[str, int]:
        return {k: b.dropped for k, b in self.buckets.items() if b.dropped}


def text(value: object, limit: int = MAX_TEXT) -> str:
    return str(value)[:limit]


def cursors(value: object) -> list[int] | None:
    """A data window [first, last] as the trainer sends it; None for anything else."""
    if (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        return list(value)
    return None


def number(value: object) -> float | None:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) or math.isnan(x) else None
