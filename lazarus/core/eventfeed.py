"""The run's events as they come, for a reader that polls (`lazarus run`, `lazarus up`, the
tests' local cluster): each poll is one read that returns only the events not returned before.

"Not returned before" goes by etcd revision, not by key. An event's key holds its writer's
clock (lazarus.core.records.Keys: events/<time_ns>-<writer>), and the writers are the leader
and every node's agent, on hosts whose clocks differ, each taking a moment between stamping a
key and writing it: an event can land under a key older than one already read, and a read
that started after the last key returned would lose it. So a poll reads the keys created
after the revision the previous poll read at; etcd filters them and sends only those.
"""

from __future__ import annotations

from lazarus.core import etcd as E
from lazarus.core.records import EventRecord, Keys, RecordError


class EventFeed:
    def __init__(self, etcd: E.Etcd, keys: Keys, *, since_ns: int | None = None):
        """`since_ns`: only the events whose keys are dated after it (by their writer's
        clock), e.g. since a job was submitted; else every event etcd holds, at first."""
        self.etcd = etcd
        self._prefix = keys.events
        self._start = None if since_ns is None else f"{keys.events}{since_ns:020d}\0"
        self._read_at = 0  # the revision of the last read; 0: none yet

    def new_events(self) -> list[EventRecord]:
        """The events created since the last call, by key (oldest first within a call); those
        that are not records are skipped. Raises EtcdUnavailable, and then the next call
        returns what this one would have."""
        out = []
        for kv in self._read():
            try:
                out.append(EventRecord.from_json(kv.value))
            except RecordError:
                continue
        return out

    def _read(self) -> list[E.KV]:
        got, self._read_at = E.reread_if_compacted(lambda: self.etcd.created_after(
            self._prefix, after_revision=self._read_at, start=self._start), times=2)
        return got
