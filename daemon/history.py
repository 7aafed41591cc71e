"""The run's history past etcd's retention, as JSON lines in the daemon's data dir.

The leader keeps etcd small (lazarus.daemon.retention): events, old round records and
checkpoint records past a retention leave etcd. Before they do, they are appended here and
fsynced: nothing is deleted from etcd that is not on disk first. Readers (`lazarus events` and
GetRunHealth through the API, `lazarus report --history`) merge these files with what etcd
still holds, one record per key.

    DATA_DIR/history/<root>/events.jsonl        one line per record:
    DATA_DIR/history/<root>/rounds.jsonl          {"key": etcd key, "revision": its mod
    DATA_DIR/history/<root>/checkpoints.jsonl      revision, "record": the record's JSON}

A crash between an append and its delete appends the same records again at the next prune;
readers keep the line with the highest revision per key. A torn last line (a crash in the
middle of a write) is skipped.

Only the leader appends. A standby that takes over appends to its own data dir: when the
daemons share one (one host, or a shared filesystem), the files hold the whole history;
otherwise each daemon's files hold what it pruned while it led, and its API shows etcd plus
those (docs/architecture.md, "Keyspace and retention").
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from lazarus.core import etcd as E
from lazarus.core.records import EventRecord, Keys, RecordError, load_json

EVENTS, ROUNDS, CHECKPOINTS = "events", "rounds", "checkpoints"
KINDS = (EVENTS, ROUNDS, CHECKPOINTS)


@dataclass(frozen=True, slots=True)
class _File:
    offset: int                       # bytes parsed so far (up to the last whole line)
    records: dict[str, E.KV]          # key -> its newest archived version


class History:
    """The archive of one key root. Safe to read from several threads (the API's)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._files: dict[str, _File] = {}
        self._events: tuple[dict, dict[str, tuple[E.KV, EventRecord]]] = ({}, {})

    @classmethod
    def at(cls, data_dir: Path, keys: Keys) -> History:
        """The archive of `keys.root` under a daemon's data dir."""
        return cls(Path(data_dir) / "history" / (keys.root.strip("/").replace("/", "_")
                                                 or "root"))

    def path(self, kind: str) -> Path:
        assert kind in KINDS, kind
        return self.directory / f"{kind}.jsonl"

    def append(self, kind: str, kvs: list[E.KV]) -> None:
        """Append records to the archive durably: on disk when this returns."""
        if not kvs:
            return
        lines = "".join(json.dumps({"key": kv.key, "revision": kv.mod_revision,
                                    **_payload(kv.value)}, sort_keys=True) + "\n"
                        for kv in kvs).encode()
        self.directory.mkdir(parents=True, exist_ok=True)
        new = not self.path(kind).exists()
        # One write with O_APPEND: two daemons that both believe they lead (a deposed leader
        # has not noticed yet) interleave whole batches, never parts of lines.
        fd = os.open(self.path(kind), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            rest = memoryview(lines)
            while rest:
                rest = rest[os.write(fd, rest):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:  # the file's name is durable too
            dfd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def read(self, kind: str) -> dict[str, E.KV]:
        """key -> archived record (its newest version), read incrementally: each call parses
        only what was appended since the last one."""
        path = self.path(kind)
        with self._lock:
            known = self._files.get(kind, _File(0, {}))
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size < known.offset:  # replaced or truncated by hand: read it anew
                known = _File(0, {})
            if size == known.offset:
                return known.records
            with open(path, "rb") as f:
                f.seek(known.offset)
                chunk = f.read(size - known.offset)
            whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
            records = dict(known.records)
            for line in whole.splitlines():
                kv = _parse(line)
                if kv is not None and (kv.key not in records
                                       or records[kv.key].mod_revision <= kv.mod_revision):
                    records[kv.key] = kv
            self._files[kind] = _File(known.offset + len(whole), records)
            return records

    def events(self) -> dict[str, tuple[E.KV, EventRecord]]:
        """key -> readable archived event; parsed once, however often it is asked for."""
        records = self.read(EVENTS)
        with self._lock:
            source, parsed = self._events
            if source is not records:
                parsed = _readable(records)
                self._events = (records, parsed)
            return parsed


def merged_events(history: History | None, snap: E.Snapshot,
                  keys: Keys) -> list[tuple[E.KV, EventRecord]]:
    """Every readable event, archived or in `snap` (etcd's copy when both hold a key), oldest
    first (keys start with their writer's time in ns)."""
    everything = {**(history.events() if history is not None else {}),
                  **_readable(snap.prefix(keys.events))}
    return [everything[key] for key in sorted(everything)]


def _readable(kvs: dict[str, E.KV]) -> dict[str, tuple[E.KV, EventRecord]]:
    out = {}
    for key, kv in kvs.items():
        try:
            out[key] = (kv, EventRecord.from_json(kv.value, key))
        except RecordError:
            continue
    return out


def _payload(value: bytes) -> dict:
    """The record as JSON when it is JSON (readable in the file), else its bytes as text."""
    try:
        return {"record": load_json(value, "record")}
    except RecordError:
        return {"raw": value.decode("utf-8", "replace")}


def _parse(line: bytes) -> E.KV | None:
    try:
        doc = load_json(line, "history line")
        key, rev = doc["key"], doc["revision"]
        value = (json.dumps(doc["record"], sort_keys=True).encode() if "record" in doc
                 else str(doc["raw"]).encode())
    except (RecordError, KeyError, TypeError):
        return None  # a torn or foreign line
    if not isinstance(key, str) or not isinstance(rev, int) or isinstance(rev, bool):
        return None
    return E.KV(key=key, value=value, create_revision=rev, mod_revision=rev, version=1,
                lease=0)
