"""Retention: the leader keeps events, round records and checkpoint records in etcd only
while they are recent, so that a run of weeks keeps a keyspace of the same size as a run of
minutes (docs/architecture.md, "Keyspace and retention").

What goes is chosen by `plan()`, a pure function of one snapshot and the clock: past a count
(the newest N of each kind stay) or an age (records that carry a time: events and checkpoint
records), never the round the run is in, the checkpoint it restores, the newest good
checkpoint of its job that passes the daemon's check (lazarus.daemon.ckptcheck: records of an
older version were agents' to write, and forged newer ones must not push the real one out),
nor the newest good one a round of the job restored. That last is the one the ranks
themselves vouched for (one that failed its restore is marked bad): where the daemon does not
see the storage, the check cannot tell a forged `step-N` claim from a real one, and N forged
newer records would otherwise leave nothing real in etcd to fall back to.
Checkpoint claims need no retention: the leader deletes each as it judges it. Retention deletes
records only, never a directory: what is on disk is the trainer's (keep_last, by manifests). The Pruner appends what goes to the daemon's history files
(lazarus.daemon.history) and only then deletes it, in transactions fenced on the leader's
epoch and on each record's mod revision (a checkpoint re-marked since it was read stays).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from lazarus.core import etcd as E
from lazarus.core.errors import UserError
from lazarus.core.jobspec import JobSpec
from lazarus.core.records import CheckpointRecord, Keys, RecordError, RoundRecord, RunStatus
from lazarus.daemon import ckptcheck
from lazarus.daemon.history import CHECKPOINTS, EVENTS, ROUNDS, History
from lazarus.daemon.leader import Leadership

log = logging.getLogger("lazarus.daemon")

PRUNE_EVERY_S = 60.0
# Keys per delete transaction: etcd refuses more than 128 operations in one (--max-txn-ops),
# and each key has a compare besides the leader's.
BATCH = 100
# A backlog (a cluster that ran before retention existed) goes over several ticks a second
# apart, so that no pass of the loop is held up for long.
MAX_PER_TICK = 2000
DAY_S = 86400.0

_NUMBERED = re.compile(r"\d+")
_EVENT_TIME = re.compile(r"(\d+)-")


@dataclass(kw_only=True, slots=True, frozen=True)
class Retention:
    """How much of each kind etcd keeps. Events: what `lazarus events` replays without the
    history files; rounds: a round record is read again only for the current round;
    checkpoints: far more than any trainer keeps on disk (keep_last), plus the protected."""
    events: int = 1000
    rounds: int = 50
    checkpoints: int = 50
    max_age_s: float = 7 * DAY_S

    @classmethod
    def parse(cls, text: str) -> Retention:
        """`events=1000,rounds=50,checkpoints=50,days=7` (any subset; the rest default)."""
        fields = {"events": int, "rounds": int, "checkpoints": int, "days": float}
        given: dict = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in fields:
                raise UserError(f"--retention: unknown kind {name!r} (known: "
                                f"{', '.join(fields)})")
            try:
                given[name] = fields[name](value)
            except ValueError:
                raise UserError(f"--retention {name}: {value.strip()!r} is not a number") from None
            if not given[name] >= 1:
                raise UserError(f"--retention {name} must be at least 1, got {value.strip()}")
        days = given.pop("days", None)
        return cls(**given, **({"max_age_s": days * DAY_S} if days is not None else {}))


def plan(now: float, snap: E.Snapshot, keys: Keys,
         retention: Retention) -> dict[str, list[E.KV]]:
    """kind -> the records to prune, oldest first. Keys not of our making (no number where
    ours have one) are left alone: nothing of ours adds to them."""
    # Unreadable: the status protects nothing by name (the counts still keep the newest);
    # without the job no record is checked (the newest good one is protected).
    status = _record(snap, keys.status, RunStatus)
    job = _record(snap, keys.accepted_job, JobSpec)
    return {EVENTS: _events(now, snap.prefix(keys.events), keys, retention),
            ROUNDS: _rounds(snap.prefix(keys.rounds), keys, retention, status),
            CHECKPOINTS: _checkpoints(now, snap.prefix(keys.checkpoints), keys, retention,
                                      status, job, _restored(snap.prefix(keys.rounds)))}


def _record(snap: E.Snapshot, key: str, cls):
    kv = snap.kvs.get(key)
    if kv is None:
        return None
    try:
        return cls.from_json(kv.value, key)
    except RecordError:
        return None


def _events(now: float, kvs: dict[str, E.KV], keys: Keys, retention: Retention) -> list[E.KV]:
    # An event's key starts with its writer's time in ns: its age without parsing it.
    timed = []
    for key, kv in kvs.items():
        m = _EVENT_TIME.match(key[len(keys.events):])
        if m:
            timed.append((int(m.group(1)) / 1e9, key, kv))
    timed.sort(key=lambda t: t[1])
    cut = max(0, len(timed) - retention.events)
    return [kv for i, (t, _, kv) in enumerate(timed) if i < cut or t < now - retention.max_age_s]


def _rounds(kvs: dict[str, E.KV], keys: Keys, retention: Retention,
            status: RunStatus | None) -> list[E.KV]:
    numbered = sorted((int(k[len(keys.rounds):]), kv) for k, kv in kvs.items()
                      if _NUMBERED.fullmatch(k[len(keys.rounds):]))
    current = status.round if status is not None else None
    cut = max(0, len(numbered) - retention.rounds)
    return [kv for n, kv in numbered[:cut] if n != current]


def _restored(kvs: dict[str, E.KV]) -> set[tuple[str, int, str]]:
    """(path, step, job) of every checkpoint a round in `kvs` restored from storage."""
    out = set()
    for key, kv in kvs.items():
        try:
            rec = RoundRecord.from_json(kv.value, key)
        except RecordError:
            continue
        if rec.restore:
            out.add((rec.restore, rec.restore_step, rec.job_id))
    return out


def _checkpoints(now: float, kvs: dict[str, E.KV], keys: Keys, retention: Retention,
                 status: RunStatus | None, job: JobSpec | None = None,
                 restored: set[tuple[str, int, str]] = frozenset()) -> list[E.KV]:
    records = []
    for key, kv in kvs.items():
        if _NUMBERED.fullmatch(key[len(keys.checkpoints):]):
            try:
                rec = CheckpointRecord.from_json(kv.value, key)
            except RecordError:
                rec = None  # garbage under our numbering: it goes by count like the rest
            records.append((int(key[len(keys.checkpoints):]), kv, rec))
    records.sort(key=lambda r: r[0])
    protected = set()
    if status is not None:
        checked = job is not None and job.id == status.job_id
        # the newest good record of the run that passes the check: checked newest first
        newest = next((r for r in reversed(records)
                       if r[2] is not None and r[2].job_id == status.job_id and r[2].good
                       and (not checked or ckptcheck.why_not(r[2], job) is None)), None)
        # the newest good one a round restored: what the ranks verified, forged or not
        vouched = next((r for r in reversed(records)
                        if r[2] is not None and r[2].job_id == status.job_id and r[2].good
                        and (r[2].path, r[2].step, r[2].job_id) in restored), None)
        protected = {r[0] for r in [newest, vouched] if r is not None} | {
            r[0] for r in records
            if r[2] is not None and status.restore and r[2].path == status.restore}
    cut = max(0, len(records) - retention.checkpoints)
    return [kv for i, (step, kv, rec) in enumerate(records)
            if step not in protected and (i < cut or (
                rec is not None and rec.committed_at
                and rec.committed_at < now - retention.max_age_s))]


class Pruner:
    """Call `tick(leadership)` once a pass: at most one prune every `every_s`, only while
    leading, and only with a history to keep what it prunes."""

    def __init__(self, etcd: E.Etcd, keys: Keys, history: History | None,
                 retention: Retention | None = None, *, every_s: float = PRUNE_EVERY_S):
        self.etcd = etcd
        self.keys = keys
        self.history = history
        self.retention = retention or Retention()
        self.every_s = every_s
        self._next = 0.0
        self._archive_error: str | None = None

    def tick(self, leadership: Leadership) -> int:
        """Prunes what is due; returns how many records it deleted from etcd."""
        now = time.monotonic()
        if self.history is None or not leadership.is_leader or now < self._next:
            return 0
        self._next = now + self.every_s
        snap = self.etcd.snapshot([self.keys.status, self.keys.accepted_job, self.keys.events,
                                   self.keys.rounds, self.keys.checkpoints])
        todo = plan(time.time(), snap, self.keys, self.retention)
        pruned = 0
        for kind, kvs in todo.items():
            for i in range(0, len(kvs), BATCH):
                if pruned >= MAX_PER_TICK:
                    self._next = now + 1.0  # the rest at the next tick but one
                    return self._done(pruned)
                batch = kvs[i:i + BATCH]
                if not self._archive(kind, batch):
                    return self._done(pruned)
                compare = [leadership.fence(),
                           *(E.mod_revision_is(kv.key, kv.mod_revision) for kv in batch)]
                if not self.etcd.txn(compare, [E.delete_op(kv.key) for kv in batch]):
                    # deposed, or a record changed since the read: the next tick reads again
                    leadership.check()
                    return self._done(pruned)
                pruned += len(batch)
        return self._done(pruned)

    def _archive(self, kind: str, batch: list[E.KV]) -> bool:
        assert self.history is not None
        try:
            self.history.append(kind, batch)
        except OSError as e:
            # Without the copy nothing is deleted: etcd keeps growing, which is an alarm of
            # its own (NOSPACE) only much later; this says why now, once per cause.
            if str(e) != self._archive_error:
                self._archive_error = str(e)
                log.error("cannot append to the history in %s (%s): etcd keeps the records "
                          "past retention until this is fixed", self.history.directory, e)
            return False
        if self._archive_error is not None:
            log.info("history in %s writable again; pruning resumes", self.history.directory)
            self._archive_error = None
        return True

    def _done(self, pruned: int) -> int:
        if pruned:
            log.info("retention: %d record(s) moved from etcd to %s", pruned,
                     self.history.directory)
        return pruned
