"""What the controller sees: one consistent etcd snapshot, parsed into records.

Parsing never fails as a whole: a record that is garbage is left out and named in `ignored`,
so one bad key (typed by hand, written by another version) cannot stop the controller.
"""

from __future__ import annotations

import json

from dataclasses import dataclass, field

from lazarus.core import jobspec
from lazarus.core.etcd import Snapshot
from lazarus.core.records import (CheckpointRecord, Keys, NodeRecord, NodeStatus, RecordError,
                             RoundRecord, RunStatus)


@dataclass(slots=True)
class ClusterView:
    revision: int = 0
    submitted: jobspec.JobSpec | None = None  # what `lazarus submit` wrote last
    job: jobspec.JobSpec | None = None        # the job the run accepted (run/job)
    status: RunStatus | None = None
    status_mod_revision: int = 0
    status_garbled: bool = False            # run/status exists but cannot be read
    latest_round: RoundRecord | None = None  # the highest-numbered round record
    round: RoundRecord | None = None        # the record of status.round
    last_round: int = 0                     # highest round number ever written
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    node_status: dict[str, NodeStatus] = field(default_factory=dict)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)  # by step
    cordoned: set[str] = field(default_factory=set)
    # Operator commands (see lazarus.core.records). Revisions order them against checkpoint
    # commits without trusting anybody's clock.
    checkpoint_revision: dict[int, int] = field(default_factory=dict)  # step -> mod revision
    drains: dict[str, int] = field(default_factory=dict)   # node -> request revision
    pause_revision: int | None = None
    cancel_requested: bool = False
    cancel_job_id: str | None = None       # the run a cancel was meant for, when it says
    checkpoint_request_revision: int = 0
    ignored: dict[str, str] = field(default_factory=dict)  # key -> why it was ignored
    # What is derived from the view once and read by several (the straggler judgement, for
    # decide() and ListNodes), each entry stored with what it was derived from (the revision,
    # or the very record) and used only while that still holds: whoever changes a view in
    # place moves its revision.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def latest_checkpoint(self) -> CheckpointRecord | None:
        return self.checkpoints[-1] if self.checkpoints else None


def parse(snap: Snapshot, keys: Keys) -> ClusterView:
    view = ClusterView(revision=snap.revision)
    rounds: dict[int, RoundRecord] = {}
    for key, kv in snap.kvs.items():
        try:
            if key == keys.job:
                view.submitted = jobspec.JobSpec.from_json(kv.value)
            elif key == keys.accepted_job:
                view.job = jobspec.JobSpec.from_json(kv.value)
            elif key == keys.status:
                view.status_mod_revision = kv.mod_revision
                view.status_garbled = True
                view.status = RunStatus.from_json(kv.value, key)
                view.status_garbled = False
            elif key.startswith(keys.rounds):
                rec = RoundRecord.from_json(kv.value, key)
                rounds[rec.round] = rec
            elif key.startswith(keys.nodes):
                rec = NodeRecord.from_json(kv.value, key)
                if rec.node != key[len(keys.nodes):]:
                    raise RecordError(f"{key}: names node {rec.node!r}")
                view.nodes[rec.node] = rec
            elif key.startswith(keys.nodestatus):
                rec = NodeStatus.from_json(kv.value, key)
                view.node_status[rec.node] = rec
            elif key.startswith(keys.checkpoints):
                rec = CheckpointRecord.from_json(kv.value, key)
                view.checkpoints.append(rec)
                view.checkpoint_revision[rec.step] = kv.mod_revision
            elif key.startswith(keys.drains):
                view.drains[key[len(keys.drains):]] = kv.mod_revision
            elif key == keys.pause:
                view.pause_revision = kv.mod_revision
            elif key == keys.cancel:
                view.cancel_requested = True
                doc = json.loads(kv.value or b"{}")
                view.cancel_job_id = doc.get("job_id") if isinstance(doc, dict) else None
            elif key == keys.checkpoint_request:
                view.checkpoint_request_revision = kv.mod_revision
            elif key.startswith(keys.cordon):
                view.cordoned.add(key[len(keys.cordon):])
        except (ValueError, TypeError, KeyError) as e:  # RecordError, UserError, bad JSON
            view.ignored[key] = str(e)
    view.checkpoints.sort(key=lambda c: c.step)
    view.last_round = max(rounds, default=0)
    view.latest_round = rounds.get(view.last_round)
    if view.status is not None:
        view.round = rounds.get(view.status.round)
    return view
