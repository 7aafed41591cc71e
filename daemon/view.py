"""What the controller sees: the records under our key root, parsed into a ClusterView.

One parser, two sources: a snapshot read at one revision (`parse`), or the daemon's informer
(lazarus.daemon.cache) through `LiveView`, which keeps every key's parsed record and re-parses
only the keys that changed since its last view. A pass then costs the parses of what changed
plus copies of the maps of nodes, never a parse of every node's status.

Parsing never fails as a whole: a record that is garbage is left out and named in `ignored`,
so one bad key (typed by hand, written by another version) cannot stop the controller. Record
parsing is total (lazarus.core.records): whatever a value holds, it is a record or a
RecordError.

A node's status counts only when it is bound to the lease its registration is bound to: every
agent can write every key, but only the node's own agent holds that lease, so a status under
another lease (another agent's, or none while the registration has one) or of an unregistered
node is not the node's, and is ignored like garbage. (An expired lease deletes both keys in
one revision, so the two never disagree for a moment.)

Checkpoint claims (ckptclaims/) are the agents' to write, so there may be any number of them,
of any value: a view holds the newest MAX_CLAIMS by key (step order) with their values parsed,
garbage included (the leader deletes it like a claim it refuses), and counts the rest, which
the leader deletes unread (lazarus.daemon.ckptcheck.adopt_claims).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from lazarus.core import jobspec
from lazarus.core.etcd import KV, Etcd, Snapshot
from lazarus.core.records import (CheckpointRecord, EventRecord, Keys, NodeRecord, NodeStatus,
                                  RecordError, RoundRecord, RunStatus, load_json)
from lazarus.daemon.cache import Informer

# Claims a view holds, the newest by key: what one pass of the leader looks at.
MAX_CLAIMS = 8


@dataclass(frozen=True, slots=True)
class Claim:
    """A key under ckptclaims/: an agent's report of a commit, or garbage there."""
    key: str
    record: CheckpointRecord | None  # None: unreadable (see `problem`)
    mod_revision: int = 0
    problem: str = ""


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
    # The lease TTL of each node whose registration went away (the lease ran out or was
    # revoked): a lost node's fault is dated one TTL before its loss is seen. History the
    # watch saw, not state a snapshot holds: left out of a view's equality.
    departed_ttl: dict[str, int] = field(default_factory=dict, compare=False)
    # Collectives a second of each node's ranks in its round, from its two newest statuses
    # that differ in them (a script that reports no steps: NodeStatus.collectives). History
    # too, as above: a snapshot alone has one status a node, and no rate.
    collective_rate: dict[str, float] = field(default_factory=dict, compare=False)
    node_status: dict[str, NodeStatus] = field(default_factory=dict)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)  # by step
    # The newest MAX_CLAIMS checkpoint claims, by key; and how many older ones there are.
    claims: list[Claim] = field(default_factory=list)
    older_claims: int = 0
    cordoned: set[str] = field(default_factory=set)
    # Who cordoned each of those when it was not an operator: "preflight" (the leader, for a
    # failed preflight: lazarus.daemon.preflight lifts it when one passes again).
    cordon_by: dict[str, str] = field(default_factory=dict)
    # Why each was cordoned, where its cordon says (a failed preflight, a node that alone
    # cannot read a checkpoint, a drain's reason); shown by `lazarus nodes`.
    cordon_reason: dict[str, str] = field(default_factory=dict)
    # Operator commands (see lazarus.core.records). Revisions order them against checkpoint
    # commits without trusting anybody's clock.
    checkpoint_revision: dict[int, int] = field(default_factory=dict)  # step -> mod revision
    drains: dict[str, int] = field(default_factory=dict)   # node -> request revision
    pause_revision: int | None = None
    cancel_requested: bool = False
    cancel_job_id: str | None = None       # the run a cancel was meant for, when it says
    checkpoint_request_revision: int = 0
    ignored: dict[str, str] = field(default_factory=dict)  # key -> why it was ignored
    # What the API reports and decide() never reads: the leader's key as etcd holds it, and
    # the readable events, oldest first (unreadable ones are skipped, not `ignored`).
    leader: KV | None = None
    events: list[tuple[KV, EventRecord]] = field(default_factory=list)
    # What is derived from the view once and read by several (the straggler judgement, for
    # decide() and ListNodes), each entry stored with what it was derived from (the revision,
    # or the very record) and used only while that still holds: whoever changes a view in
    # place moves its revision.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def latest_checkpoint(self) -> CheckpointRecord | None:
        return self.checkpoints[-1] if self.checkpoints else None


def prefixes(keys: Keys) -> list[str]:
    """Every prefix a view is parsed from (not torchrun's keys, which can be many)."""
    return [keys.leader, keys.job, keys.root + "run/", keys.rounds, keys.nodes,
            keys.nodestatus, keys.checkpoints, keys.claims, keys.cordon,
            keys.root + "commands/", keys.events]


def parse(snap: Snapshot, keys: Keys) -> ClusterView:
    builder = ViewBuilder(keys)
    builder.apply(snap.kvs.items())
    return builder.build(snap.revision)


# What a key contributes to a view: (kind, payload). Kinds that name a node or a key keep
# their payload in a map of their own; the others are singletons.
_Entry = tuple[str, object]


class ViewBuilder:
    """Every key's parsed record; `apply` re-parses the keys that changed, `build` assembles a
    view from what is parsed. Not thread-safe (LiveView locks around it)."""

    def __init__(self, keys: Keys):
        self.keys = keys
        self._entries: dict[str, _Entry] = {}
        self._one: dict[str, object] = {}   # kind -> payload of the singleton keys
        self._nodes: dict[str, NodeRecord] = {}
        self._departed_ttl: dict[str, int] = {}
        self._collective_rate: dict[str, float] = {}
        self._replaced: dict[str, NodeStatus] = {}  # a node's status a change took away
        self._node_lease: dict[str, int] = {}
        self._statuses: dict[str, tuple[NodeStatus, int]] = {}  # readable ones, with leases
        self._node_status: dict[str, NodeStatus] = {}  # those bound to their node's lease
        self._unbound: dict[str, str] = {}  # status key -> why it is not its node's
        self._drains: dict[str, int] = {}
        self._cordoned: set[str] = set()
        self._cordon_by: dict[str, str] = {}
        self._cordon_reason: dict[str, str] = {}
        self._ignored: dict[str, str] = {}
        # Kept by key, assembled in key order at build time (as a snapshot lists them): few.
        self._rounds: dict[str, RoundRecord] = {}
        self._checkpoints: dict[str, tuple[CheckpointRecord, int]] = {}
        self._claims: dict[str, Claim] = {}
        self._events: dict[str, tuple[KV, EventRecord]] = {}
        self._derived: dict[str, object] = {}  # what build() assembled from those, until they change
        self._last: ClusterView | None = None

    def apply(self, changes: Iterable[tuple[str, KV | None]]) -> int:
        """Bring the parsed records up to `changes` (key -> its new KV, None: deleted);
        returns how many keys were parsed."""
        parsed = 0
        for key, kv in changes:
            old = self._entries.pop(key, None)
            if old is not None:
                self._drop(key, old)
            if kv is None:
                continue
            entry = self._parse(key, kv)
            parsed += 1
            if entry is not None:
                self._entries[key] = entry
                self._add(key, entry)
        return parsed

    def _parse(self, key: str, kv: KV) -> _Entry | None:
        k = self.keys
        try:
            if key == k.job:
                return "submitted", jobspec.JobSpec.from_json(kv.value, key)
            if key == k.accepted_job:
                return "job", jobspec.JobSpec.from_json(kv.value, key)
            if key == k.status:
                try:
                    return "status", (RunStatus.from_json(kv.value, key), kv.mod_revision, None)
                except RecordError as e:
                    return "status", (None, kv.mod_revision, str(e))
            if key == k.leader:
                return "leader", kv
            if key.startswith(k.rounds):
                rec = RoundRecord.from_json(kv.value, key)
                if key != k.round_key(rec.round):
                    raise RecordError(f"{key}: holds round {rec.round}")
                return "round", rec
            if key.startswith(k.nodes):
                return "node", (_named(NodeRecord.from_json(kv.value, key), key, k.nodes),
                                kv.lease)
            if key.startswith(k.nodestatus):
                return "nodestatus", (_named(NodeStatus.from_json(kv.value, key), key,
                                             k.nodestatus), kv.lease)
            if key.startswith(k.checkpoints):
                return "checkpoint", (CheckpointRecord.from_json(kv.value, key), kv.mod_revision)
            if key.startswith(k.claims):
                return "claim", _claim(key, kv, k)
            if key.startswith(k.events):
                try:
                    return "event", (kv, EventRecord.from_json(kv.value, key))
                except RecordError:
                    return None
            if key.startswith(k.drains):
                return "drain", kv.mod_revision
            if key == k.pause:
                return "pause", kv.mod_revision
            if key == k.cancel:
                doc = load_json(kv.value or b"{}", key)
                job_id = doc.get("job_id") if isinstance(doc, dict) else None
                if not isinstance(job_id, (str, type(None))):
                    raise RecordError(f"{key}: job_id is not a job id")
                return "cancel", job_id
            if key == k.checkpoint_request:
                return "checkpoint_request", kv.mod_revision
            if key.startswith(k.cordon):
                return "cordon", _cordon_by(kv.value)
        except RecordError as e:
            return "ignored", str(e)
        return None

    def _name(self, key: str, kind: str) -> str:
        prefix = {"node": self.keys.nodes, "nodestatus": self.keys.nodestatus,
                  "drain": self.keys.drains, "cordon": self.keys.cordon}[kind]
        return key[len(prefix):]

    def _add(self, key: str, entry: _Entry) -> None:
        kind, payload = entry
        if kind == "nodestatus":
            name = self._name(key, kind)
            self._statuses[name] = payload
            self._collectives(name, self._replaced.pop(name, None), payload[0])
            self._bind(name)
        elif kind == "node":
            name = self._name(key, kind)
            self._nodes[name], self._node_lease[name] = payload
            self._departed_ttl.pop(name, None)
            self._bind(name)
        elif kind == "event":
            self._events[key] = payload
            self._derived.pop("events", None)
        elif kind == "round":
            self._rounds[key] = payload
            self._derived.pop("rounds", None)
        elif kind == "checkpoint":
            self._checkpoints[key] = payload
            self._derived.pop("checkpoints", None)
        elif kind == "claim":
            self._claims[key] = payload
            self._derived.pop("claims", None)
        elif kind == "drain":
            self._drains[self._name(key, kind)] = payload
        elif kind == "cordon":
            name = self._name(key, kind)
            self._cordoned.add(name)
            by, reason = payload
            for table, value in ((self._cordon_by, by), (self._cordon_reason, reason)):
                if value:
                    table[name] = value
                else:
                    table.pop(name, None)
        elif kind == "ignored":
            self._ignored[key] = payload
        else:
            self._one[kind] = payload
            if kind == "status" and payload[2] is not None:
                self._ignored[key] = payload[2]

    def _drop(self, key: str, entry: _Entry) -> None:
        kind, _ = entry
        if kind == "nodestatus":
            name = self._name(key, kind)
            self._replaced[name] = self._statuses.pop(name)[0]
            self._bind(name)
        elif kind == "node":
            name = self._name(key, kind)
            self._departed_ttl[name] = self._nodes[name].lease_ttl_s
            del self._nodes[name], self._node_lease[name]
            self._bind(name)
        elif kind == "event":
            del self._events[key]
            self._derived.pop("events", None)
        elif kind == "round":
            del self._rounds[key]
            self._derived.pop("rounds", None)
        elif kind == "checkpoint":
            del self._checkpoints[key]
            self._derived.pop("checkpoints", None)
        elif kind == "claim":
            del self._claims[key]
            self._derived.pop("claims", None)
        elif kind == "drain":
            del self._drains[self._name(key, kind)]
        elif kind == "cordon":
            self._cordoned.discard(self._name(key, kind))
            self._cordon_by.pop(self._name(key, kind), None)
            self._cordon_reason.pop(self._name(key, kind), None)
        else:
            self._ignored.pop(key, None)
            if kind != "ignored":
                del self._one[kind]

    def _collectives(self, node: str, before: NodeStatus | None, now: NodeStatus) -> None:
        """The node's collective rate once `now` replaced `before`: kept while its
        collectives stand still (a status written for another reason), dropped with the
        round or when none are reported."""
        if (now.collectives < 0 or before is None or before.round != now.round
                or before.collectives < 0):
            self._collective_rate.pop(node, None)
            return
        done, spent = now.collectives - before.collectives, now.collective_at - before.collective_at
        if done > 0 and spent > 0:
            self._collective_rate[node] = done / spent

    def _bind(self, node: str) -> None:
        """Count node's status, or not, after a change of it or of its registration: O(1)."""
        key = self.keys.nodestatus_key(node)
        self._node_status.pop(node, None)
        self._unbound.pop(key, None)
        if node not in self._statuses:
            return
        status, lease = self._statuses[node]
        registered = self._node_lease.get(node)
        if registered == lease:
            self._node_status[node] = status
        elif registered is None:
            self._unbound[key] = f"{key}: {self.keys.node_key(node)} is not registered"
        else:
            self._unbound[key] = (f"{key}: written under lease {lease:x}, not under "
                                  f"{self.keys.node_key(node)}'s lease {registered:x}: not "
                                  "the node's own agent")

    def build(self, revision: int) -> ClusterView:
        """A view of what is parsed now. Its maps are the view's own: nothing the builder
        does later changes a view already built."""
        one = self._one
        status, status_rev, garbled = one.get("status", (None, 0, None))
        rounds = self._assembled("rounds", lambda: {
            rec.round: rec for _, rec in sorted(self._rounds.items())})
        checkpoints, checkpoint_revision = self._assembled("checkpoints", self._checkpoint_list)
        events = self._assembled("events", lambda: [self._events[k]
                                                    for k in sorted(self._events)])
        # The newest few without sorting them all: a flood of claims costs O(claims) a build.
        claims = self._assembled("claims", lambda: [
            self._claims[k] for k in sorted(heapq.nlargest(MAX_CLAIMS, self._claims))])
        last_round = max(rounds, default=0)
        view = ClusterView(
            revision=revision, submitted=one.get("submitted"), job=one.get("job"),
            status=status, status_mod_revision=status_rev, status_garbled=garbled is not None,
            latest_round=rounds.get(last_round), last_round=last_round,
            round=rounds.get(status.round) if status is not None else None,
            nodes=dict(self._nodes), departed_ttl=dict(self._departed_ttl),
            collective_rate=dict(self._collective_rate),
            node_status=dict(self._node_status),
            checkpoints=list(checkpoints), cordoned=set(self._cordoned),
            claims=list(claims), older_claims=len(self._claims) - len(claims),
            cordon_by=dict(self._cordon_by), cordon_reason=dict(self._cordon_reason),
            checkpoint_revision=dict(checkpoint_revision), drains=dict(self._drains),
            pause_revision=one.get("pause"), cancel_requested="cancel" in one,
            cancel_job_id=one.get("cancel"),
            checkpoint_request_revision=one.get("checkpoint_request", 0),
            ignored={**self._ignored, **self._unbound}, leader=one.get("leader"),
            events=list(events))
        # A node's throughput summary is read again only when its status is a new record
        # (lazarus.daemon.stragglers): a view starts from the summaries its predecessor read.
        if self._last is not None and "summaries" in self._last.memo:
            view.memo["summaries"] = self._last.memo["summaries"]
        self._last = view
        return view

    def _assembled(self, what: str, make: Callable[[], object]):
        if what not in self._derived:
            self._derived[what] = make()
        return self._derived[what]

    def _checkpoint_list(self) -> tuple[list[CheckpointRecord], dict[int, int]]:
        ordered = sorted(self._checkpoints.items())
        revisions = {rec.step: rev for _, (rec, rev) in ordered}
        return sorted((rec for _, (rec, _) in ordered), key=lambda c: c.step), revisions


def _claim(key: str, kv: KV, keys: Keys) -> Claim:
    """A claim's value parsed, or why it is garbage (kept: the leader deletes it)."""
    try:
        rec = CheckpointRecord.from_json(kv.value, key)
    except RecordError as e:
        return Claim(key, None, kv.mod_revision, str(e))
    if key != keys.claim_key(rec.step):
        return Claim(key, None, kv.mod_revision, f"{key}: claims step {rec.step}")
    return Claim(key, rec, kv.mod_revision)


def _named(rec, key: str, prefix: str):
    """The record of a key that names a node must name the same node."""
    if rec.node != key[len(prefix):]:
        raise RecordError(f"{key}: names node {rec.node!r}")
    return rec


class LiveView:
    """The view kept current from an informer on `keys.root`: what every daemon (leader or
    standby) decides from and serves its API from. Thread-safe: the loop and the API's
    threads share it, and a view is built at most once per revision.

    `on_change(keys)` is called (on the etcd client's thread) with the keys of the view that
    changed: it must only note them and wake someone up."""

    def __init__(self, etcd: Etcd, keys: Keys, *,
                 on_change: Callable[[Collection[str]], None] | None = None):
        self.keys = keys
        self.informer = Informer(etcd, keys.root, prefixes(keys), on_change=on_change)
        self._changes = self.informer.subscribe()
        self._builder = ViewBuilder(keys)
        self._view: ClusterView | None = None
        self._lock = threading.Lock()
        self.parsed = 0  # keys parsed so far (what a pass costs, for tests and benchmarks)

    def current(self) -> ClusterView:
        """The view of what the informer holds now (it lists etcd at the first call: that
        one may raise EtcdUnavailable)."""
        self.informer.start()
        with self._lock:
            revision, changes = self._changes.drain()
            if changes:
                self.parsed += self._builder.apply(changes.items())
            if self._view is None or changes or revision != self._view.revision:
                self._view = self._builder.build(revision)
            return self._view

    def fresh(self, timeout_s: float) -> ClusterView:
        """The view once the informer holds every change etcd had made when called (waiting
        at most `timeout_s`: see Informer.sync)."""
        self.informer.start()
        self.informer.sync(timeout_s)
        return self.current()

    def stop(self) -> None:
        self.informer.stop()


MAX_CORDON_REASON = 300


def _cordon_by(value: bytes) -> tuple[str, str]:
    """(who, why) of a cordon, where its value says: who is "preflight" for the leader's
    cordon of a failed preflight, "" for any other (an operator's, a drain's); why is its
    reason, clipped. Bytes that are not JSON are simply a cordon."""
    try:
        doc = load_json(value, "cordon")
    except RecordError:
        return "", ""
    if not isinstance(doc, dict):
        return "", ""
    by, reason = doc.get("by"), doc.get("reason")
    return (by if by == "preflight" else "",
            reason[:MAX_CORDON_REASON] if isinstance(reason, str) else "")
