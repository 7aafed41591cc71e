"""The daemon's copy of etcd's keys under its root: an informer (list once, then watch).

    list the prefixes at revision R  ->  watch the root from R + 1, applying puts and deletes
    to a map key -> KV (value, mod revision, lease)  ->  on a compacted or broken watch that
    cannot resume, list again and tell the subscribers what the new list changed

Readers never read etcd for the state: they take the keys that changed since they last looked
(`subscribe`), and `revision` says up to which revision of etcd the map is complete (the
compactor keeps the history after it). A node's registration is bound to its agent's lease, so
an agent whose lease expired shows as the delete of its key, like any other delete.

Consistency: a watch delivers a revision's events together (one transaction of the leader is
one revision), and the map takes them in together, so no reader ever sees half a transaction.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Collection, Sequence

from lazarus.core import etcd as E

log = logging.getLogger("lazarus.daemon")


class Subscription:
    """The keys that changed since the last `drain`, each with its newest KV (None: deleted)."""

    def __init__(self, informer: Informer):
        self._informer = informer
        self.pending: dict[str, E.KV | None] = {}

    def drain(self) -> tuple[int, dict[str, E.KV | None]]:
        """(the revision the informer is complete up to, what changed since the last drain)."""
        with self._informer._cond:
            changes, self.pending = self.pending, {}
            return self._informer.revision, changes


class Informer:
    """Lists `prefixes` (all under `root`) once and keeps them current from one watch on
    `root`; keys under the root outside the prefixes are not kept (torchrun's store).

    `on_change(keys)` is called with the changed keys after the map took them in: on the etcd
    client's thread, so it must only note them and wake someone up. `start()` lists
    (EtcdUnavailable when etcd does not answer; call it again); after that the informer never
    raises: a broken watch resumes, a compacted one lists again (lazarus.core.etcd.Watch)."""

    def __init__(self, etcd: E.Etcd, root: str, prefixes: Sequence[str], *,
                 on_change: Callable[[Collection[str]], None] | None = None):
        assert all(p.startswith(root) for p in prefixes), (root, prefixes)
        self.etcd = etcd
        self.root = root
        self.prefixes = tuple(prefixes)
        self.on_change = on_change
        self.revision = 0   # the map holds every change up to this revision
        self.lists = 0      # full reads so far: 1, plus one per re-list
        self._kvs: dict[str, E.KV] = {}
        self._cond = threading.Condition()
        self._start_lock = threading.Lock()
        self._subscriptions: list[Subscription] = []
        self._staged: list[E.Event] = []
        self._watch: E.Watch | None = None

    # -- what readers use ----------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._watch is not None

    def subscribe(self) -> Subscription:
        """A feed of changes, starting with every key the map holds now."""
        sub = Subscription(self)
        with self._cond:
            sub.pending = dict(self._kvs)
            self._subscriptions.append(sub)
        return sub

    def snapshot(self) -> E.Snapshot:
        """A copy of the map, as a snapshot at `revision` (O(keys): for tests and tools)."""
        with self._cond:
            return E.Snapshot(revision=self.revision, kvs=dict(self._kvs))

    def wait_for(self, revision: int, timeout_s: float) -> bool:
        """Wait until the map holds every change up to `revision`; False after `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: self.revision >= revision, timeout_s)

    def sync(self, timeout_s: float) -> bool:
        """Wait until the map holds every change etcd had made when called (one cheap read of
        etcd's revision; raises EtcdUnavailable when etcd does not answer). A change outside
        our root moves etcd's revision without an event for us: then this waits `timeout_s`
        and returns False (the map is as current as our watch can make it)."""
        return self.wait_for(self.etcd.revision(self.root), timeout_s)

    # -- list and watch ------------------------------------------------------------------------
    def start(self) -> None:
        """List, then watch. Does nothing when started already."""
        with self._start_lock:
            if self._watch is not None:
                return
            revision = self._list()
            self._watch = self.etcd.watch_prefix(self.root, start_revision=revision + 1,
                                                 on_events=self._on_events,
                                                 on_resync=self._relist)

    def stop(self) -> None:
        with self._start_lock:
            if self._watch is not None:
                self._watch.cancel()

    def _list(self) -> int:
        snap = self.etcd.snapshot(self.prefixes)
        with self._cond:
            changed = {k: kv for k, kv in snap.kvs.items()
                       if (old := self._kvs.get(k)) is None or old.mod_revision != kv.mod_revision}
            changed.update({k: None for k in self._kvs if k not in snap.kvs})
            self._kvs = dict(snap.kvs)
            self.revision = snap.revision
            self.lists += 1
            self._publish(changed)
        if changed and self.on_change is not None:
            self.on_change(changed.keys())
        return snap.revision

    def _relist(self) -> int:
        """The watch cannot resume (its revision was compacted): list again. Runs on a
        thread of its own while the watch waits for the revision to go on from."""
        revision = self._list()
        log.info("re-listed %s at revision %d after the watch fell behind", self.root, revision)
        return revision + 1

    def _on_events(self, events: list[E.Event]) -> None:
        # On the etcd client's loop: the events of one watch answer arrive one call at a time,
        # all before the loop runs anything else; commit them together after the last one.
        if not self._staged:
            asyncio.get_running_loop().call_soon(self._commit)
        self._staged.extend(events)

    def _commit(self) -> None:
        events, self._staged = self._staged, []
        changed: dict[str, E.KV | None] = {}
        with self._cond:
            for ev in events:
                kv = ev.kv
                if kv.mod_revision <= self.revision:
                    continue  # already in a list taken after it
                if kv.key.startswith(self.prefixes):
                    if ev.kind == "DELETE":
                        if self._kvs.pop(kv.key, None) is not None:
                            changed[kv.key] = None
                    else:
                        self._kvs[kv.key] = changed[kv.key] = kv
            if events:
                self.revision = max(self.revision, events[-1].kv.mod_revision)
            self._publish(changed)
        if changed and self.on_change is not None:
            self.on_change(changed.keys())

    def _publish(self, changed: dict[str, E.KV | None]) -> None:
        if changed:
            for sub in self._subscriptions:
                sub.pending.update(changed)
        self._cond.notify_all()
