"""The etcd key schema and the records stored under it (JSON values).

Every key lives under ROOT (default ``/lazarus/v1/``; several clusters can share one etcd with
different roots).

    leader                    daemon leader: {"id", "pid", "host", "api"}; bound to the
                              leader's lease; its create_revision is the leader's epoch
    job                       JobSpec (lazarus.core.jobspec), written by `lazarus submit`
    run/job                   the job the run accepted (a copy of `job` taken by the leader, so
                              a garbled or repeated submission cannot disturb a running run)
    run/status                RunStatus: state machine of the run; only the leader writes it
    run/round                 the current round number as ASCII digits: the fencing token
                              agents compare against before committing a checkpoint
    rounds/<round:08d>        RoundRecord: membership, ranks, store, checkpoint to restore
    nodes/<node>              NodeRecord: an agent's registration, bound to its lease
    nodestatus/<node>         NodeStatus: what the agent's workers are doing, bound to the
                              same lease (a status under any other lease is not the
                              node's agent's: the daemon ignores it)
    ckptclaims/<step:012d>    a CheckpointRecord as a claim: the agent of global rank 0
                              reports a commit here, fenced on run/round; the leader checks it
                              (lazarus.daemon.ckptcheck), makes it a record or refuses it, and
                              deletes it either way
    checkpoints/<step:012d>   CheckpointRecord: a committed checkpoint the leader adopted from
                              a claim; only the leader writes it (and rewrites `good`), so an
                              agent's credentials can neither lose one nor choose a restore
    events/<time_ns:020d>-<writer>   Event: a state change with its reason
    cordon/<node>             present = the node takes no new work (operator's choice)
    commands/checkpoint       a request for a checkpoint now: {"id", "requested_at"}; agents
                              pass a new id on to their workers
    commands/drain/<node>     drain NODE: checkpoint, then a new round without it (a spare
                              takes its place); {"requested_at"}
    commands/pause            present = the run pauses after a checkpoint; deleted = resume
    commands/cancel           present = the run ends as CANCELLED
    torchrun/<run_id>/state   torchrun's rendezvous state (lazarus.rendezvous), for
    torchrun/<run_id>/store/  users of `torchrun --rdzv-backend lazarus-etcd`; leased

Records read back from etcd may be garbage (a person with etcdctl, a different version, a
bug): every `from_json`, and `load_json` for values without a record class, is total. It
returns a record whose fields all have their annotated types (nested ones too: the annotations
are the schema), or raises RecordError, whatever the bytes; readers log the key once and skip
it. Where a key names a node, its record names the same node.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lazarus.core import jobcommand
from lazarus.core.contract import HangVerdict
from lazarus.core.settings import DEFAULT_ROOT, LEASE_TTL_S


# Round numbers fit the width of their keys (rounds/<round:08d>), which then sort in order.
MAX_ROUND = 10**8
# Ranks on one node, at most: every reader of a round makes a list of a node's ranks.
MAX_RANKS_PER_NODE = 1024
# What a node status carries of a failed rank's last output.
OUTPUT_TAIL_BYTES = 2048

# Run states (docs/architecture.md, "Run states"): PENDING -> RENDEZVOUS -> RUNNING ->
# RECOVERING -> RENDEZVOUS ...
PENDING, RENDEZVOUS, RUNNING, RECOVERING = "PENDING", "RENDEZVOUS", "RUNNING", "RECOVERING"
SUCCEEDED, FAILED, CANCELLED = "SUCCEEDED", "FAILED", "CANCELLED"
PAUSED = "PAUSED"
STATES = (PENDING, RENDEZVOUS, RUNNING, RECOVERING, PAUSED, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)

# Worker states an agent reports for its node in a round.
W_IDLE, W_STARTING, W_RUNNING, W_FAILED, W_SUCCEEDED = (
    "idle", "starting", "running", "failed", "succeeded")
WORKER_STATES = (W_IDLE, W_STARTING, W_RUNNING, W_FAILED, W_SUCCEEDED)

ROLE_ACTIVE, ROLE_SPARE = "active", "spare"

# Monitor verdicts in an agent's health report (lazarus.agent.health).
H_HEALTHY, H_DEGRADED, H_FAILED = "healthy", "degraded", "failed"


class RecordError(ValueError):
    """A value under our keys that is not a record we understand."""


@dataclass(frozen=True, slots=True)
class Keys:
    root: str = DEFAULT_ROOT

    def __post_init__(self):
        if not self.root.startswith("/") or not self.root.endswith("/"):
            raise ValueError(f"key root {self.root!r} must start and end with '/'")

    @property
    def leader(self) -> str: return self.root + "leader"
    @property
    def job(self) -> str: return self.root + "job"
    @property
    def accepted_job(self) -> str: return self.root + "run/job"
    @property
    def status(self) -> str: return self.root + "run/status"
    @property
    def round(self) -> str: return self.root + "run/round"
    @property
    def rounds(self) -> str: return self.root + "rounds/"
    @property
    def nodes(self) -> str: return self.root + "nodes/"
    @property
    def nodestatus(self) -> str: return self.root + "nodestatus/"
    @property
    def checkpoints(self) -> str: return self.root + "checkpoints/"
    @property
    def claims(self) -> str: return self.root + "ckptclaims/"
    @property
    def events(self) -> str: return self.root + "events/"
    @property
    def cordon(self) -> str: return self.root + "cordon/"
    @property
    def checkpoint_request(self) -> str: return self.root + "commands/checkpoint"
    @property
    def drains(self) -> str: return self.root + "commands/drain/"
    @property
    def pause(self) -> str: return self.root + "commands/pause"
    @property
    def cancel(self) -> str: return self.root + "commands/cancel"

    def drain_key(self, node: str) -> str: return self.drains + node

    def round_key(self, n: int) -> str: return f"{self.rounds}{n:08d}"
    def node_key(self, node: str) -> str: return self.nodes + node
    def nodestatus_key(self, node: str) -> str: return self.nodestatus + node
    def checkpoint_key(self, step: int) -> str: return f"{self.checkpoints}{step:012d}"
    def claim_key(self, step: int) -> str: return f"{self.claims}{step:012d}"
    def cordon_key(self, node: str) -> str: return self.cordon + node

    def event_key(self, writer: str) -> str:
        return f"{self.events}{time.time_ns():020d}-{writer}"


# What any value under our keys must be before a reader looks inside, whoever wrote it: JSON
# nested at most MAX_DEPTH deep (a deeper one makes json, copy and dataclasses.asdict recurse
# until Python gives up; our own records nest 5 deep), integers below 2**63 in magnitude
# (protobuf's int64), and text that is Unicode (a lone surrogate, legal as a JSON escape, breaks
# every encoder after us: protobuf, logs, UTF-8). Floats may be NaN or infinite, as Python's
# json writes a loss that blew up: the fields readers compute with are typed `float`, which
# admits finite numbers below 2**63 only (see _fits), and what sits in an untyped dict or list
# is read through `number()`.
MAX_DEPTH = 32
MAX_NUMBER = 2**63


def load_json(raw: bytes, what: str) -> Any:
    """The JSON value in `raw` if it is one a reader can handle (see MAX_DEPTH); else
    RecordError naming `what`. Total: nothing else is raised, whatever `raw` holds."""
    try:
        # As json.loads would, but strict: it lets UTF-8-encoded surrogates through.
        text = raw.decode(json.detect_encoding(raw))
        doc = json.loads(text)
    except RecursionError:
        raise RecordError(f"{what}: nested too deep") from None
    except (ValueError, TypeError) as e:  # UnicodeDecodeError and the 4300-digit cap too
        raise RecordError(f"{what}: not JSON ({_short(str(e))})") from None
    # A lone surrogate can only come from a \uXXXX escape now: texts are looked at only then.
    _check_tree(doc, what, texts="\\u" in text and _SURROGATE_ESCAPE.search(text) is not None)
    return doc


def number(value: Any) -> float | None:
    """`value` as a float if it is a finite number a reader can compute with, else None: for
    numbers out of an untyped dict of a record (an event's fields), which nothing checked."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if -MAX_NUMBER < value < MAX_NUMBER else None  # NaN is not


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_tree(doc: Any, what: str, *, texts: bool) -> None:
    """Every value in `doc` fits (see MAX_DEPTH), and with `texts` every text is Unicode. A
    loop over the tree's levels, so a deep one cannot recurse; a node status (~400 values)
    costs about as much as parsing it."""
    level, depth = [doc], 0
    while level:
        deeper = []
        for value in level:
            if type(value) is dict:
                if texts:
                    _check_texts(value, what)
                children = value.values()
            elif type(value) is list:
                children = value
            else:
                children = (value,)
            for child in children:
                kind = type(child)
                if kind is float:
                    continue
                if kind is dict or kind is list:
                    deeper.append(child)
                elif kind is int and not -MAX_NUMBER < child < MAX_NUMBER:
                    raise RecordError(f"{what}: integer out of range (at most 2**63 in "
                                      "magnitude)")
                elif texts and kind is str:
                    _check_texts((child,), what)
        if deeper and depth == MAX_DEPTH:
            raise RecordError(f"{what}: nested more than {MAX_DEPTH} deep")
        level, depth = deeper, depth + 1


def _check_texts(texts, what: str) -> None:
    for text in texts:
        if not text.isascii() and _SURROGATE.search(text):
            raise RecordError(f"{what}: text with a lone UTF-16 surrogate")


def _load(raw: bytes, what: str) -> dict:
    doc = load_json(raw, what)
    if not isinstance(doc, dict):
        raise RecordError(f"{what}: expected a JSON object")
    return doc


def _build(cls, doc: dict, what: str):
    """Construct a record from a dict, checking every field against its annotation: the
    annotations are the schema of the nested values readers index into."""
    kwargs = {}
    for name, required, fits in _schema(cls):
        if name not in doc:
            if required:
                raise RecordError(f"{what}: missing field {name!r}")
            continue
        value = doc[name]
        if not fits(value):
            raise RecordError(f"{what}: field {name!r} has the wrong type ({_short(value)})")
        kwargs[name] = value
    try:
        record = cls(**kwargs)
        record._check()
    except RecordError as e:
        raise RecordError(f"{what}: {str(e).removeprefix(cls.__name__ + ': ')}") from None
    return record


@functools.cache
def _schema(cls) -> list[tuple[str, bool, Callable[[Any], bool]]]:
    """(field, required, its type's check) of a record class, made once."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return [(f.name, f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING, _fits(hints[f.name]))
            for f in dataclasses.fields(cls)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.cache
def _fits(hint: Any) -> Callable[[Any], bool]:
    """A check that a JSON value has type `hint`: int, float (finite, an int too), Reading
    (any number), str, bool, None, list, dict, list[X], dict[str, X], a TypedDict (its keys
    required, others allowed) or a union of those. bool is no number here: `round: true` is a
    mistake."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:  # Reading, the one annotation used
        return _is_number
    if origin in (typing.Union, types.UnionType):
        checks = [_fits(h) for h in args]
        return lambda v: any(check(v) for check in checks)
    if origin is list:
        item = _fits(args[0])
        return lambda v: type(v) is list and all(map(item, v))
    if origin is dict:
        item = _fits(args[1])
        return lambda v: type(v) is dict and all(map(item, v.values()))
    if typing.is_typeddict(hint):
        keys = [(k, _fits(h)) for k, h in typing.get_type_hints(hint).items()]
        return lambda v: type(v) is dict and all(k in v and check(v[k]) for k, check in keys)
    if hint is type(None):
        return lambda v: v is None
    if hint is float:
        return lambda v: number(v) is not None
    if hint is int:
        return _is_int
    return lambda v: isinstance(v, hint)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Record:
    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, what: str = ""):
        """The record in `raw`, or RecordError; nothing else, whatever `raw` holds."""
        return _build(cls, _load(raw, what or cls.__name__), what or cls.__name__)

    def _check(self) -> None:
        """What a record read from etcd must satisfy beyond its fields' types (records built
        in code are trusted)."""


# A measurement a worker reported, shown and never computed with: NaN or infinite on a step
# that blew up (a loss spike), so any float, where `float` admits finite numbers only.
Reading = typing.Annotated[float, "any float"]


class Incident(typing.TypedDict):
    """RunStatus.incident: the fault being recovered from. Readers index these keys; a
    kind may add its own (a loss spike's steps)."""
    kind: str
    culprit: str
    fault_at: float       # wall time of the fault
    detected_at: float    # wall time the daemon saw it
    round: int            # the round it hit


@dataclass(frozen=True, slots=True)
class RunStatus(_Record):
    job_id: str
    state: str
    round: int = 0
    members: list[str] = field(default_factory=list)
    reason: str = ""
    since: float = 0.0           # wall time the state was entered
    restarts: int = 0
    restore: str | None = None   # checkpoint the current round restores
    restore_step: int = 0
    incident: Incident | None = None  # the open incident
    # Loss-spike rollbacks: data windows every later round skips, and a lowered LR until a step.
    skip_windows: list[list[int]] = field(default_factory=list)
    lr_scale: float = 1.0
    lr_scale_until: int = 0
    # Stragglers reported in this run: node -> {"round", "reason"}; reported once a round.
    stragglers: dict = field(default_factory=dict)
    # Members whose host monitor fails (checkpoint dir full or unwritable, ...): node ->
    # reasons; alerted once when a node enters, once when it leaves (lazarus.daemon.hostalert).
    host_alerts: dict = field(default_factory=dict)
    # Rounds in a row whose ranks crashed before the round ran (every member's ranks
    # running), and how (their exit codes): EARLY_FAILURES the same way fail the run.
    early_failures: int = 0
    early_failure: str = ""

    def __post_init__(self):
        if self.state not in STATES:
            raise RecordError(f"RunStatus: unknown state {self.state!r}")

    def _check(self) -> None:
        # Each restart is a round: the daemon adds one to either, and must read the sum back.
        if not (0 <= self.round < MAX_ROUND and 0 <= self.restarts < MAX_ROUND):
            raise RecordError(f"round {self.round} or restarts {self.restarts} is no count of "
                              "rounds")


@dataclass(frozen=True, slots=True)
class RoundRecord(_Record):
    round: int
    job_id: str
    members: list[str]           # node ids in rank order
    nproc_per_node: int
    world_size: int
    dp: int
    tp: int
    store_host: str
    store_port: int
    restore: str | None = None
    restore_step: int = 0
    train: dict = field(default_factory=dict)
    # Restore from memory (tier 0) instead of `restore`: {"step": the step, "sources":
    # {global rank: node that holds its copy}} (lazarus.daemon.tier0).
    tier0: dict | None = None
    # What every rank runs, from the job (lazarus.core.jobcommand): the command, added
    # environment and working directory; torchrun's TORCHELASTIC_RESTART_COUNT and
    # TORCHELASTIC_MAX_RESTARTS.
    command: list[str] = field(default_factory=lambda: list(jobcommand.BUILTIN))
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    restarts: int = 0
    max_restarts: int = 0
    # Replica groups (docs/replicas.md): `replicas` consecutive equal blocks of `members`;
    # `replica_rounds[r]`: the round replica r's ranks were launched in (its world's store),
    # this round for a replica that starts now, an earlier one for a replica whose ranks go
    # on untouched ("carried"); `replica_epoch`: the round of the last whole-world start,
    # which names the quorum's store namespace. [] and 0 with one replica.
    replicas: int = 1
    replica_rounds: list[int] = field(default_factory=list)
    replica_epoch: int = 0

    def ranks_of(self, node: str) -> list[int]:
        i = self.members.index(node)
        return list(range(i * self.nproc_per_node, (i + 1) * self.nproc_per_node))

    def replica_of(self, node: str) -> int:
        return self.members.index(node) // (len(self.members) // self.replicas)

    def replica_members(self, replica: int) -> list[str]:
        k = len(self.members) // self.replicas
        return self.members[replica * k:(replica + 1) * k]

    @property
    def rank_world(self) -> int:
        """Ranks in each rank's own world: its replica's, or the round's with one replica."""
        return self.world_size // self.replicas

    def carried(self, replica: int) -> bool:
        """Replica `replica`'s ranks go on from an earlier round, untouched."""
        return self.replicas > 1 and self.replica_rounds[replica] < self.round

    def carries(self, node: str, launched: int | None) -> bool:
        """Whether this round carries `node`'s ranks on untouched from round `launched`, the
        one they were launched in (a replica round's other replicas: docs/replicas.md)."""
        if self.replicas <= 1 or node not in self.members:
            return False
        r = self.replica_of(node)
        return self.carried(r) and self.replica_rounds[r] == launched

    @property
    def checkpoint_dir(self) -> str | None:
        """Where the round's checkpoints go (its [train.checkpoint] dir), if anywhere."""
        return self.train.get("checkpoint", {}).get("dir")

    def _check(self) -> None:
        if not 0 < self.round < MAX_ROUND:
            raise RecordError(f"round {self.round} is not a round number")
        if not 1 <= self.nproc_per_node <= MAX_RANKS_PER_NODE:
            raise RecordError(f"nproc_per_node must be 1..{MAX_RANKS_PER_NODE}, got "
                              f"{self.nproc_per_node}")
        if self.replicas < 1 or self.replicas > 1 and (
                len(self.members) % self.replicas or len(self.replica_rounds) != self.replicas
                or not all(isinstance(r, int) and 0 < r <= self.round for r in self.replica_rounds)
                or not 0 < self.replica_epoch <= min(self.replica_rounds)):
            raise RecordError(f"round {self.round}: replicas {self.replicas} of "
                              f"{len(self.members)} member(s), replica_rounds "
                              f"{_short(self.replica_rounds)}, replica_epoch "
                              f"{self.replica_epoch} do not fit (docs/replicas.md)")
        # The trainer checks the rest of [train]; the agent reads this before any trainer runs.
        table = self.train.get("checkpoint", {})
        if not isinstance(table, dict) or not isinstance(table.get("dir"), (str, type(None))):
            raise RecordError(f"train.checkpoint.dir is not a path ({_short(table)})")


@dataclass(frozen=True, slots=True)
class NodeRecord(_Record):
    node: str
    host: str
    nproc: int
    role: str = ROLE_ACTIVE
    store_port: int = 0
    pid: int = 0
    started_at: float = 0.0
    gpu_backend: str = "none"
    lease_ttl_s: int = LEASE_TTL_S  # how long this node's death takes to show as a lost lease
    # The agent runs preflight checks (lazarus.agent.preflight): the node takes no work
    # before its status says they passed.
    preflight: bool = False
    replica_port: int = 0           # where its agent takes tier-0 copies (0: it takes none)

    def __post_init__(self):
        if self.role not in (ROLE_ACTIVE, ROLE_SPARE):
            raise RecordError(f"NodeRecord: unknown role {self.role!r}")
        if self.nproc < 1:
            raise RecordError(f"NodeRecord: nproc must be >= 1, got {self.nproc}")


@dataclass(frozen=True, slots=True)
class NodeStatus(_Record):
    node: str
    round: int = 0
    workers: str = W_IDLE
    exit_codes: dict[str, int] = field(default_factory=dict)  # local rank -> a dead one's code
    failed_rank: int | None = None
    step: int = 0
    loss: Reading = 0.0          # NaN or infinite after a step that blew up
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    pids: list[int] = field(default_factory=list)
    parked: int = 0
    updated_at: float = 0.0
    fault_at: float = 0.0       # wall time the agent saw the failure
    spikes: list = field(default_factory=list)  # recent skipped steps: {"step", "window", ...}
    window: list = field(default_factory=list)  # data cursors [first, last] of the last step
    health: dict = field(default_factory=dict)  # monitors: {"state", "gpu": {...}, "host": {...}}
    hang: dict | None = None    # the round's hang report (lazarus.agent.hang.HangVerdict + stacks)
    throughput: dict = field(default_factory=dict)  # lazarus.core.throughput summary()
    # A local rank in a checkpoint or an eval: {"since": wall time it entered (0: none now),
    # "until": wall time the last such phase ended}. Peers elsewhere wait for it meanwhile.
    long_phase: dict = field(default_factory=dict)
    # Why a rank refused the job (exitcodes.REFUSED: e.g. another job's checkpoints in its
    # dir); the run fails with it.
    refused: str = ""
    # The last preflight (lazarus.agent.preflight.summary): {"state": passed | failed,
    # "at": wall time, "cost_s", "reason": why it failed}; {} before the first is done.
    preflight: dict = field(default_factory=dict)
    # The tier-0 copies the node holds (lazarus.agent.tier0.Tier0Store.holdings): {"job",
    # "world", "ranks": {global rank: [steps]}, "bytes", "limit"}; its memory use, reported.
    tier0: dict = field(default_factory=dict)
    # What its ranks found wrong in the checkpoint they were to restore (exitcodes
    # .BAD_CHECKPOINT): {"checkpoint", "kind" (lazarus.core.contract.RESTORE_KINDS), "reason"}.
    restore_failed: dict = field(default_factory=dict)
    # The last lines the failed rank printed (its log: stdout and stderr), for the event and
    # `lazarus status` (at most OUTPUT_TAIL_BYTES).
    output_tail: str = ""
    # The global ranks of the round that run in a process kept from the round before (in-place
    # recovery: docs/inplace.md); the others started anew.
    in_place: list[int] = field(default_factory=list)
    # Why the others started anew: reason (lazarus.agent.workers ANEW_*) -> global ranks.
    anew: dict[str, list[int]] = field(default_factory=dict)
    # Processes of its ranks a SIGKILL could not end (in the kernel, on a mount that never
    # answers): [{"pid", "rank" (global; None: no round's), "why"}], a few
    # (lazarus.agent.workers.Workers.set_aside). The daemon cordons the node and replaces it.
    unkillable: list[dict] = field(default_factory=list)
    # What is known of a script that reports no steps (level 0, lazarus.trainer.collwatch):
    # the collectives every rank of the node has issued in the round (the least of its
    # ranks': each collective is issued by every rank, so a sum would count it once per rank
    # and change with the world size; -1: none reported), and the wall time of the newest
    # report of one. Carried by the writes made anyway (docs/architecture.md, "Write
    # budget"); the daemon derives the rate from two successive statuses.
    collectives: int = -1
    collective_at: float = 0.0

    def __post_init__(self):
        if self.workers not in WORKER_STATES:
            raise RecordError(f"NodeStatus: unknown worker state {self.workers!r}")

    def _check(self) -> None:
        if self.hang is None:
            return
        try:
            HangVerdict.from_dict(self.hang)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RecordError(f"unreadable hang report ({e})") from None
        if number(self.hang.get("at")) is None:
            raise RecordError(f"hang report without its time ({_short(self.hang.get('at'))})")


@dataclass(frozen=True, slots=True)
class CheckpointRecord(_Record):
    """A committed checkpoint (checkpoints/), or an agent's claim of one (ckptclaims/), whose
    `good` and `manifest_sha256` mean nothing: the leader sets both when it adopts it."""
    step: int
    path: str
    round: int
    job_id: str = ""
    committed_at: float = 0.0
    good: bool = True
    # The manifest the leader read when it adopted the record ("" where it saw no storage): a
    # claim of the same step replaces the record only with another manifest, a new save.
    manifest_sha256: str = ""


@dataclass(frozen=True, slots=True)
class EventRecord(_Record):
    time: float
    kind: str
    message: str
    round: int = 0
    state: str = ""
    fields: dict = field(default_factory=dict)


def writer_id() -> str:
    return f"{os.uname().nodename}.{os.getpid()}"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()
