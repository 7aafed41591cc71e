"""The agent's assignment as etcd has it: run/status and the record of its round, read with
the checkpoint request in one snapshot. When the agent reads it (on news from its watches,
else every REREAD_S) is the agent's loop's business (lazarus.agent.service.Agent.assignment).

A value that is not a record is read around, as if absent, and named once per write of it,
not at every read: record parsing is total (lazarus.core.records), so one bad key typed by
hand stops nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lazarus.core import etcd as E
from lazarus.core.records import RecordError, RoundRecord, RunStatus

if TYPE_CHECKING:
    from lazarus.agent.service import Agent

log = logging.getLogger("lazarus.agent")


def read(agent: Agent) -> tuple[RunStatus | None, RoundRecord | None]:
    """(run/status, the record of its round); (None, None) while run/status is unreadable.
    The checkpoint request read with them goes to the ranks (through the agent, whose
    `_pass_on_checkpoint_request` the fleet simulator calls too)."""
    keys = agent.keys
    snap = agent.etcd.snapshot([keys.status, keys.round, keys.checkpoint_request])
    agent._pass_on_checkpoint_request(snap.kvs.get(keys.checkpoint_request))
    status = rec = None
    kv = snap.kvs.get(keys.status)
    if kv is not None:
        status = readable(agent._unreadable, RunStatus, kv)
        if status is None:
            return None, None
    if status is not None and status.round:
        kv = agent.etcd.get(keys.round_key(status.round))
        if kv is not None:
            rec = readable(agent._unreadable, RoundRecord, kv)
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
