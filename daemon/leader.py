"""Leader election on an etcd lease, with the key's create revision as the fencing epoch.

A lease is not a lock: a paused leader may still believe it leads after its lease expired.
So every write the leader makes is a transaction that compares the leader key's
create_revision with the epoch it won; a deposed leader's writes simply fail.
"""

from __future__ import annotations

import json
import logging

from lazarus.core import etcd as E
from lazarus.core.records import Keys

log = logging.getLogger(__name__)


class Leadership:
    """Campaigns for `keys.leader`. `ttl_s` is how long a dead leader keeps the post: a
    standby takes over within one TTL of the leader's death."""

    def __init__(self, etcd: E.Etcd, keys: Keys, *, ttl_s: int, identity: dict):
        self.etcd = etcd
        self.keys = keys
        self.ttl_s = ttl_s
        self.identity = identity
        self.session: E.Session | None = None
        self.epoch: int | None = None

    @property
    def is_leader(self) -> bool:
        return self.epoch is not None and self.session is not None and not self.session.lost.is_set()

    def campaign(self) -> bool:
        """One attempt; True when this process leads (now or already)."""
        if self.is_leader:
            return True
        if self.session is None or self.session.lost.is_set():
            self.epoch = None
            self.session = E.Session(self.etcd, ttl_s=self.ttl_s)
        value = json.dumps({**self.identity, "lease": self.session.lease}).encode()
        try:
            self.etcd.txn([E.key_missing(self.keys.leader)],
                          [E.put_op(self.keys.leader, value, lease=self.session.lease)])
        except E.LeaseLost:
            self.session.mark_lost()  # expired while etcd was away: a new one next time
            return False
        kv = self.etcd.get(self.keys.leader)
        if kv is not None and kv.lease == self.session.lease:
            self.epoch = kv.create_revision
            log.info("leading with epoch %d", self.epoch)
            return True
        return False

    def fence(self):
        assert self.epoch is not None, "fence() without leadership"
        return E.create_revision_is(self.keys.leader, self.epoch)

    def check(self) -> bool:
        """After a failed fenced write: do we still lead? Drops leadership if not."""
        kv = self.etcd.get(self.keys.leader)
        if kv is None or kv.create_revision != self.epoch:
            log.warning("lost leadership (epoch %s)", self.epoch)
            self.epoch = None
        return self.is_leader

    def resign(self) -> None:
        if self.session is not None:
            if self.is_leader:
                try:
                    self.etcd.txn([self.fence()], [E.delete_op(self.keys.leader)])
                except E.EtcdUnavailable:
                    pass
            self.session.close()
        self.session = None
        self.epoch = None
