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
                              same lease
    checkpoints/<step:012d>   CheckpointRecord: a committed checkpoint, written by the agent
                              of global rank 0, fenced on run/round
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

Records read back from etcd may be garbage (a person with etcdctl, a different version): each
`parse_*` raises RecordError, which readers log and skip; nothing here crashes the daemon.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from lazarus.core.settings import DEFAULT_ROOT, LEASE_TTL_S


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
    def cordon_key(self, node: str) -> str: return self.cordon + node

    def event_key(self, writer: str) -> str:
        return f"{self.events}{time.time_ns():020d}-{writer}"


def _load(raw: bytes, what: str) -> dict:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"{what}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise RecordError(f"{what}: expected a JSON object")
    return doc


def _build(cls, doc: dict, what: str):
    """Construct a record from a dict, checking the declared field types."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in doc:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordError(f"{what}: missing field {f.name!r}")
            continue
        value = doc[f.name]
        expected = _TYPES.get(f.type)
        if expected is not None and not isinstance(value, expected) or (
                isinstance(value, bool) and f.type in ("int", "float")):
            raise RecordError(f"{what}: field {f.name!r} has the wrong type ({value!r})")
        kwargs[f.name] = value
    return cls(**kwargs)


_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool, "list": list,
          "dict": dict, "str | None": (str, type(None)), "int | None": (int, type(None)),
          "dict | None": (dict, type(None)), "list[str]": list, "list[dict]": list}


class _Record:
    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, what: str = ""):
        return _build(cls, _load(raw, what or cls.__name__), what or cls.__name__)


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
    incident: dict | None = None  # open incident: {"kind", "culprit", "detected_at", "fault_at"}
    # Loss-spike rollbacks: data windows every later round skips, and a lowered LR until a step.
    skip_windows: list = field(default_factory=list)
    lr_scale: float = 1.0
    lr_scale_until: int = 0
    # Stragglers reported in this run: node -> {"round", "reason"}; reported once a round.
    stragglers: dict = field(default_factory=dict)
    # Members whose host monitor fails (checkpoint dir full or unwritable, ...): node ->
    # reasons; alerted once when a node enters, once when it leaves (lazarus.daemon.hostalert).
    host_alerts: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.state not in STATES:
            raise RecordError(f"RunStatus: unknown state {self.state!r}")


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

    def ranks_of(self, node: str) -> list[int]:
        i = self.members.index(node)
        return list(range(i * self.nproc_per_node, (i + 1) * self.nproc_per_node))


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
    exit_codes: dict = field(default_factory=dict)  # local rank -> exit code of a dead worker
    failed_rank: int | None = None
    step: int = 0
    loss: float = 0.0
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    pids: list = field(default_factory=list)
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

    def __post_init__(self):
        if self.workers not in WORKER_STATES:
            raise RecordError(f"NodeStatus: unknown worker state {self.workers!r}")


@dataclass(frozen=True, slots=True)
class CheckpointRecord(_Record):
    step: int
    path: str
    round: int
    job_id: str = ""
    committed_at: float = 0.0
    good: bool = True


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
