"""The leader compacts etcd's history, so that etcd stays bounded even where nobody set its
auto-compaction (docs/operations.md): every status write keeps a superseded revision until a
compaction drops it.

Every `every_s` the leader compacts to the newest revision that is at least `keep_s` old and
that its own watches have consumed. A watcher that falls further behind than `keep_s` (an
agent away that long) re-lists when it resumes (lazarus.core.etcd.Watch). Compaction only
frees space inside etcd's file for reuse; giving it back to the disk is a defragmentation,
which blocks the member while it runs and is left to the operator.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from lazarus.core import etcd as E

log = logging.getLogger("lazarus.daemon")

# etcd keeps every revision a write supersedes until a compaction: history = writes/s x the
# window, and at 4,096 nodes (~270 status writes/s of ~4 KB) five minutes of it is 300+ MB.
# Every 30 s keeping 60 s holds it to 60-90 s of writes (docs/architecture.md, "Write
# budget"); a watcher away longer than that re-lists, which is cheap.
COMPACT_EVERY_S = 30.0
KEEP_HISTORY_FACTOR = 2.0
KEEP_HISTORY_S = COMPACT_EVERY_S * KEEP_HISTORY_FACTOR


class Compactor:
    """Call `tick(leading=...)` once a pass; it does at most one cheap read every
    `keep_s`/10 and one compaction every `every_s`, and only while leading. `consumed()` is
    the highest revision this daemon's watches have delivered; `root`, our key prefix, is
    where the revision is read (a key this daemon may read)."""

    def __init__(self, etcd: E.Etcd, *, root: str, every_s: float = COMPACT_EVERY_S,
                 keep_s: float | None = None, consumed: Callable[[], int] | None = None):
        self.etcd = etcd
        self.root = root
        self.every_s = every_s
        self.keep_s = keep_s if keep_s is not None else every_s * KEEP_HISTORY_FACTOR
        self.consumed = consumed
        self.compacted = 0  # the revision of our last compaction
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic, revision), oldest first
        self._sample_every_s = max(0.1, self.keep_s / 10)
        self._next_sample = 0.0
        self._next_compact = time.monotonic() + every_s
        self._failed_logged = False

    def tick(self, *, leading: bool) -> int | None:
        """Returns the revision compacted to, when this tick compacted."""
        if not leading or self.every_s <= 0:
            self._samples.clear()  # a standby's samples would be stale by the time it leads
            return None
        now = time.monotonic()
        if now >= self._next_sample:
            self._next_sample = now + self._sample_every_s
            self._samples.append((now, self.etcd.revision(self.root)))
        if now < self._next_compact:
            return None
        self._next_compact = now + self.every_s
        target = self.target(now)
        if target is None:
            return None
        try:
            self.etcd.compact(target)
        except E.EtcdUnavailable as e:
            if not self._failed_logged:
                self._failed_logged = True
                log.warning("cannot compact etcd (%s); trying again every %.0f s", e,
                            self.every_s)
            return None
        self._failed_logged = False
        self.compacted = target
        log.debug("compacted etcd's history before revision %d (keeping %.0f s of it)", target,
                 self.keep_s)
        return target

    def target(self, now: float) -> int | None:
        """The newest sampled revision at least keep_s old, not past what our watches
        consumed; None when that is nothing new."""
        old = [rev for t, rev in self._samples if t <= now - self.keep_s]
        if not old:
            return None
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.keep_s:
            self._samples.popleft()  # keep the newest old-enough sample only
        target = old[-1]
        if self.consumed is not None:
            target = min(target, self.consumed())
        return target if target > self.compacted else None
