"""The agent's assignment as etcd has it: run/status and the record of its round, read with
the checkpoint request in one snapshot, when there is news of it from the agent's watches,
else every REREAD_S (`Assignment`).

A value that is not a record is read around, as if absent, and named once per write of it,
not at every read: record parsing is total (lazarus.core.records), so one bad key typed by
hand stops nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lazarus.core import etcd as E
from lazarus.core.records import Keys, RecordError, RoundRecord, RunStatus

log = logging.getLogger("lazarus.agent")


# The agent converges on its assignment often (lazarus.agent.service.RECONCILE_S), but reads
# it from etcd only when its watches on run/ and commands/ deliver news, and else this often,
# in case a watch lost something: a read per reconcile would be 16,000 reads/s on etcd at
# 4,096 nodes (docs/architecture.md, "Write budget").
REREAD_S = 10.0


class Assignment:
    """The agent's assignment (run/status and its round's record) as last read, read again
    when there is `news()` of it or it is REREAD_S old. An event that arrives during a read
    is news for the next one, never lost. `read` is the one read of etcd; the fleet simulator
    gives its agents one that serves the fleet's read instead (lazarus.sim.fleet)."""

    def __init__(self, read: Callable[[], tuple[RunStatus | None, RoundRecord | None]]):
        self._read = read
        self.current: tuple[RunStatus | None, RoundRecord | None] = (None, None)
        self._news = 1                      # counts watch deliveries ...
        self._news_read = 0                 # ... up to the one the assignment was read after
        self._read_at = -REREAD_S
        self.reads = 0                      # reads so far (the fleet counts them)

    def news(self) -> None:
        self._news += 1

    def get(self, now: float) -> tuple[RunStatus | None, RoundRecord | None]:
        if self._news != self._news_read or now - self._read_at >= REREAD_S:
            news = self._news
            self.current = self._read()
            self._news_read, self._read_at = news, now
            self.reads += 1
        return self.current


def read(etcd: E.Etcd, keys: Keys, unreadable: dict[str, int],
         on_checkpoint_request: Callable[[E.KV | None], None]
         ) -> tuple[RunStatus | None, RoundRecord | None]:
    """(run/status, the record of its round) from etcd; (None, None) while run/status is
    unreadable. The checkpoint request read with them goes to `on_checkpoint_request` (the
    ranks' news: lazarus.agent.messages.pass_on_checkpoint_request). `unreadable`: what was
    named already (`readable`)."""
    snap = etcd.snapshot([keys.status, keys.round, keys.checkpoint_request])
    on_checkpoint_request(snap.kvs.get(keys.checkpoint_request))
    status = rec = None
    kv = snap.kvs.get(keys.status)
    if kv is not None:
        status = readable(unreadable, RunStatus, kv)
        if status is None:
            return None, None
    if status is not None and status.round:
        kv = etcd.get(keys.round_key(status.round))
        if kv is not None:
            rec = readable(unreadable, RoundRecord, kv)
    return status, rec


def readable(named: dict[str, int], cls, kv: E.KV):
    """The record in `kv`, or None: an unreadable value is named once (per write of it), not
    at every read. `named`: key -> mod revision of the unreadable value named last."""
    try:
        rec = cls.from_json(kv.value, kv.key)
    except RecordError as e:
        if named.get(kv.key) != kv.mod_revision:
            named[kv.key] = kv.mod_revision
            log.warning("ignoring %s", e)
        return None
    named.pop(kv.key, None)
    return rec
