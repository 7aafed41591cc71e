"""Carries out a Decision as ONE etcd transaction, fenced twice:

- on the leader's epoch (create_revision of the leader key): a deposed leader writes nothing;
- on run/status's mod revision as read in the view: a decision taken on a stale view
  (or the same decision applied twice) fails instead of acting again.

Checkpoint claims are deleted without a compare on their own revision: agents write them,
and a compare that an agent could break at will would fail every transaction of the leader.
"""

from __future__ import annotations

import dataclasses

from lazarus.core import etcd as E
from lazarus.core.records import CheckpointRecord, EventRecord, Keys, dumps
from lazarus.daemon.actions import (AcceptJob, AdoptClaim, ClearCommand, Cordon, Decision,
                                    DropClaim, DropClaimsBelow, Emit, Uncordon,
                                    MarkCheckpoint, RejectJob, RequestCheckpoint, RequestDrain,
                                    SetStatus,
                                    StartRound)
from lazarus.daemon.leader import Leadership
from lazarus.daemon.view import ClusterView


def operations(keys: Keys, decision: Decision, view: ClusterView, *, now: float,
               writer: str) -> list:
    ops = []
    status = view.status
    # A claim adopted and its record marked bad in one pass (a rollback past it) are two
    # writes of one key, which etcd refuses in a transaction: the later one stands.
    record_op: dict[int, int] = {}

    def put_record(rec: CheckpointRecord) -> None:
        op = E.put_op(keys.checkpoint_key(rec.step), rec.to_json())
        if rec.step in record_op:
            ops[record_op[rec.step]] = op
        else:
            record_op[rec.step] = len(ops)
            ops.append(op)

    for i, action in enumerate(decision.actions):
        if isinstance(action, AcceptJob):
            ops.append(E.put_op(keys.accepted_job, action.job.to_json()))
        elif isinstance(action, SetStatus):
            status = action.status
            ops.append(E.put_op(keys.status, status.to_json()))
        elif isinstance(action, StartRound):
            ops.append(E.put_op(keys.round_key(action.record.round), action.record.to_json()))
            ops.append(E.put_op(keys.round, str(action.record.round).encode()))
        elif isinstance(action, Emit):
            ev = EventRecord(time=now, kind=action.kind, message=action.message,
                             round=status.round if status else 0,
                             state=status.state if status else "", fields=action.fields)
            ops.append(E.put_op(keys.event_key(f"{writer}-{i}"), ev.to_json()))
        elif isinstance(action, RequestCheckpoint):
            ops.append(E.put_op(keys.checkpoint_request,
                                dumps({"id": action.id, "requested_at": now})))
        elif isinstance(action, RejectJob):
            ops.append(E.delete_op(keys.job))
        elif isinstance(action, MarkCheckpoint):
            put_record(dataclasses.replace(action.checkpoint, good=action.good))
        elif isinstance(action, AdoptClaim):
            put_record(action.record)
            ops.append(E.delete_op(action.key))
        elif isinstance(action, DropClaim):
            ops.append(E.delete_op(action.key))
        elif isinstance(action, DropClaimsBelow):
            ops.append(E.delete_op(keys.claims, below=action.key))
        elif isinstance(action, RequestDrain):
            ops.append(E.put_op(keys.drain_key(action.node),
                                dumps({"requested_at": now, "reason": action.reason})))
        elif isinstance(action, Cordon):
            if action.by:
                value = dumps({"by": action.by, "reason": action.reason, "at": now})
            elif action.reason:
                value = dumps({"requested_at": now, "reason": action.reason})
            else:
                value = b"drained"
            ops.append(E.put_op(keys.cordon_key(action.node), value))
        elif isinstance(action, Uncordon):
            ops.append(E.delete_op(keys.cordon_key(action.node)))
        elif isinstance(action, ClearCommand):
            ops.append(E.delete_op(keys.root + "commands/" + action.name))
        else:
            raise AssertionError(f"unknown action {action!r}")
    return ops


def apply(etcd: E.Etcd, keys: Keys, leadership: Leadership, decision: Decision,
          view: ClusterView, *, now: float, writer: str) -> int | None:
    """The revision the transaction committed at (0: it changed nothing), None when it did
    not commit. The daemon's next decision waits until its view holds that revision: the
    compare on run/status alone would not stop a decision that leaves run/status as it is
    (an event, a drain request) from being taken twice on a view that lags its own write."""
    ops = operations(keys, decision, view, now=now, writer=writer)
    compare = [leadership.fence(), E.mod_revision_is(keys.status, view.status_mod_revision)]
    return etcd.txn_revision(compare, ops)
