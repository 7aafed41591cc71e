"""The wire contract between a worker (trainer rank), its node agent and the daemon.

Everything that crosses a process boundary on a node is defined here once, typed:
  - the environment the agent gives a worker (the *_ENV names),
  - the assignment (who the rank is in which round, where the store is),
  - progress messages on the worker channel (`Progress`, one JSON object per line),
  - the hang verdict an agent publishes in its node status (`HangVerdict`, `Position`).
Step reports and throughput rows are in lazarus.core.throughput. The agent, the trainer and
the daemon import this module; none of them imports another (docs/architecture.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.core.jobcommand import BUILTIN as BUILTIN_COMMAND

# --- environment of a worker ------------------------------------------------------------------
SOCKET_ENV = "LAZARUS_AGENT_SOCKET"     # the agent's unix socket; unset: no agent (local run)
ROUND_ENV = "LAZARUS_ROUND"
RANK_ENV = "LAZARUS_RANK"
# "off": progress() sends nothing. The agent sets it when its monitors are off (`--monitors
# off`), which exists only to measure what the monitors cost.
PROGRESS_ENV = "LAZARUS_PROGRESS"
ASSIGNMENT_ENV = "LAZARUS_ASSIGNMENT"
# Workers dump their stacks (faulthandler, on SIGUSR1) into the directory this names, one file
# per pid (`dump_path`).
STACKS_ENV = "LAZARUS_STACKS_DIR"
# Seconds a rank waits for its agent once their channel closed (the agent died, or restarts
# for an upgrade) before it stops itself: one lease TTL and a margin, so an agent back within
# its TTL finds its ranks and adopts them, and a node whose agent stays away leaves no orphans.
# Unset: the rank never reconnects and trains on without an agent.
AGENT_GRACE_ENV = "LAZARUS_AGENT_GRACE_S"
# Seconds a collective may block before the process group gives up (default: the store
# timeout). Under an agent the hang detector acts long before; plain torchrun has nothing else.
PG_TIMEOUT_ENV = "LAZARUS_PG_TIMEOUT_S"
# The same for a script of the user's own, when PG_TIMEOUT_ENV is unset: the agent sets twice
# its first-step allowance (a level-0 rank's hang allowance), in place of torch's 30 minutes
# (gloo) or 10 (NCCL), so that a rank whose agent is gone does not wait that long.
SCRIPT_PG_TIMEOUT_ENV = "LAZARUS_SCRIPT_PG_TIMEOUT_S"
# "off": the ranks of a round that lost a peer exit, and the next round starts every rank in
# a fresh process (a job sets it in its env). Otherwise the built-in trainer's surviving ranks
# stay, and the next round reuses their processes (docs/inplace.md).
IN_PLACE_ENV = "LAZARUS_IN_PLACE"
# A file to which global rank 0's Session.report() appends each step as a JSON line, the
# metrics file `lazarus report` and `lazarus up` read (a script of the user's own, level 1).
METRICS_ENV = "LAZARUS_METRICS"
# What an agent never passes on to the ranks it starts, whose code is the job's: Lazarus's own
# secrets ($LAZARUS_TOKEN, $LAZARUS_READ_TOKEN, $LAZARUS_RDZV_KEY, etcd credentials...) and
# etcdctl's. A rank needs none of them: it talks to its agent only.
_SECRET_WORDS = ("TOKEN", "KEY", "PASSWORD", "SECRET", "CREDENTIAL", "CERT")


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the variables that hold Lazarus's or etcd's credentials."""
    def secret(name: str) -> bool:
        upper = name.upper()
        return upper.startswith("ETCDCTL_") or (
            upper.startswith("LAZARUS_") and any(w in upper for w in _SECRET_WORDS))
    return {k: v for k, v in environ.items() if not secret(k)}


def dump_path(dump_dir: str | Path, pid: int) -> Path:
    """Where worker `pid` writes its stacks when the agent sends SIGUSR1."""
    return Path(dump_dir) / f"stacks-{pid}.txt"


def flight_pipe_path(dump_dir: str | Path, pid: int) -> Path:
    """The FIFO on which worker `pid` takes requests for its collectives' flight record."""
    return Path(dump_dir) / f"flight-{pid}.pipe"


def flight_record_path(dump_dir: str | Path, pid: int) -> Path:
    """Where worker `pid` writes its flight record (torch's JSON dump) when asked."""
    return Path(dump_dir) / f"flight-{pid}.json"


def worker_files(dump_dir: str | Path, pid: int) -> list[Path]:
    """The files worker `pid` answers requests through: gone with it (the exit note is read
    after its exit, and removed apart)."""
    return [dump_path(dump_dir, pid), flight_pipe_path(dump_dir, pid),
            flight_record_path(dump_dir, pid)]


def exit_note_path(dump_dir: str | Path, pid: int) -> Path:
    """Where worker `pid` leaves its exit code before it exits: an agent that adopted it (not
    its parent, so it cannot wait for it) reads it there to tell a crash from a clean end."""
    return Path(dump_dir) / f"exit-{pid}.json"


# --- the assignment -------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class WorkerAssignment:
    rank: int
    world_size: int
    local_rank: int
    round: int
    store_host: str
    store_port: int
    train: dict                  # TrainConfig.to_dict()
    restore: str | None = None   # committed checkpoint to resume from
    report_socket: str | None = None  # the local agent's unix socket; None: no agent
    job_id: str = ""             # whose checkpoints this rank writes (and may delete)
    # Tier 0 (docs/architecture.md, "Checkpoints"): the directory in host memory where this
    # rank leaves its snapshots for the agent (None: no tier 0), and the snapshot file of
    # this rank to restore from instead of `restore` (the round restores from memory).
    snapshot_dir: str | None = None
    snapshot: str | None = None
    restore_step: int = 0        # the step the round restores, whichever tier holds it
    # Where the job may write (its checkpoint dir, its metrics): the agent's --allowed-root
    # list; empty: anywhere (a `lazarus train` of the user's own)
    allowed_roots: list[str] = field(default_factory=list)
    # What the rank runs (lazarus.core.jobcommand) and how torchrun would have described it
    # (`torchrun_env`); where its output goes (one file per round and rank on its node).
    command: list[str] = field(default_factory=lambda: list(BUILTIN_COMMAND))
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    log_path: str | None = None
    group_rank: int = 0          # the node's place in the round (torchrun's GROUP_RANK)
    group_world_size: int = 1    # nodes in the round
    local_world_size: int = 1    # ranks on this node
    restart_count: int = 0       # recoveries of the run before this round
    max_restarts: int = 0
    issued_at: float = 0.0       # wall-clock time the agent handed it over (0: not said)
    # Replica groups (docs/replicas.md): the job's replicas and the round that names their
    # quorum's store namespace. The rank's replica is rank // (world_size // replicas), and
    # its own world is that replica's ranks.
    replicas: int = 1
    replica_epoch: int = 0

    @property
    def replica_place(self) -> tuple[int, int, int]:
        """(replica, rank in it, ranks per replica)."""
        per = self.world_size // self.replicas
        return self.rank // per, self.rank % per, per

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerAssignment:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise UserError(f"worker assignment is not JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: object) -> WorkerAssignment:
        if not isinstance(d, dict):
            raise UserError("worker assignment must be a JSON object")
        unknown = set(d) - {f.name for f in fields(cls)}
        missing = {f.name for f in fields(cls) if f.default is MISSING
                   and f.default_factory is MISSING} - set(d)
        if unknown or missing:
            raise UserError(f"worker assignment: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        return cls(**d)


def replicas_prefix(job_id: str, epoch: int) -> str:
    """The namespace of a job of replica groups (docs/replicas.md) in the store of members[0]'s
    agent: one per whole-world start of its replicas (the replica epoch), so a new epoch
    never reads an old one's keys. The quorum's keys live under it."""
    return f"lazarus/replicas/{job_id}/{epoch}/"


# Under replicas_prefix: the ports, comma-separated, of the stores members[0]'s agent hosts
# for the epoch's cross-replica groups (shard s's on the (s mod K)-th): their rebuilds, every
# live rank's at a replica's loss and again at its return, spread over K loop threads instead
# of queueing on the one that serves the quorum and the replicas' own rendezvous
# (docs/scale.md, "In replica mode").
SHARD_STORES_KEY = "shard_stores"
SHARD_STORES = 16


def round_port_key(round_: int) -> str:
    """The key, in the store of the agent hosting a round (`store_port`), under which that
    agent publishes the port of the round's own store: a store per round, so that a rank
    never reads a dead round's keys (torch's env:// rendezvous prefixes none)."""
    return f"lazarus/round/{round_}/port"


# cpu: ranks (and the agent's collective check) stay on the CPU on a GPU machine; cuda: they
# must have a GPU (lazarus.trainer.device).
DEVICE_ENV = "LAZARUS_DEVICE"

# Set for every rank unless the job or the node says otherwise. NCCL's default error handling
# (3, SkipCleanUp) makes its watchdog abort the whole process on a collective's timeout or a
# peer's error: the rank dies by SIGABRT and cannot say that a peer went away. 2 (CleanUpOnly)
# aborts the communicators and raises in the rank instead, which exits PEER_LOST
# (lazarus.trainer.worker, lazarus.trainer.rankrun); a SIGABRT that still comes is read from
# the rank's log (lazarus.agent.workers). Communicators are made blocking (torch's default,
# pinned): with non-blocking creation, aborting a group whose communicator waits for a lost
# rank wedged on an H200 (docs/inplace.md), and a survivor that cannot abort is restarted.
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_USE_COMM_NONBLOCKING": "0"}


def torchrun_env(a: WorkerAssignment, master_port: int) -> dict[str, str]:
    """The environment torchrun gives a rank, for this assignment: `init_process_group()`
    from the environment joins the round's store at MASTER_ADDR:MASTER_PORT as a client
    (TORCHELASTIC_USE_AGENT_STORE: the agent hosts it)."""
    return {"RANK": str(a.rank), "LOCAL_RANK": str(a.local_rank),
            "WORLD_SIZE": str(a.world_size), "LOCAL_WORLD_SIZE": str(a.local_world_size),
            "GROUP_RANK": str(a.group_rank), "GROUP_WORLD_SIZE": str(a.group_world_size),
            "ROLE_RANK": str(a.rank), "ROLE_WORLD_SIZE": str(a.world_size),
            "ROLE_NAME": "default", "MASTER_ADDR": a.store_host,
            "MASTER_PORT": str(master_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(a.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
            "TORCHELASTIC_RUN_ID": a.job_id or "lazarus",
            RANK_ENV: str(a.rank), ROUND_ENV: str(a.round)}


# --- a restore that failed -----------------------------------------------------------------
# What a rank found wrong with the checkpoint it was told to restore (a `restore_failed`
# message on the channel, then NodeStatus.restore_failed): the daemon condemns the checkpoint
# only for what is wrong with it, and cordons a node that alone cannot read it
# (lazarus.daemon.restorefail).
CORRUPT = "corrupt"        # a checksum, a size, a malformed manifest: the checkpoint's fault
ABSENT = "missing"         # the directory, its manifest or a listed file is not there
UNREADABLE = "unreadable"  # the storage refused to read here, or the checkpoint root is absent
RESTORE_KINDS = (CORRUPT, ABSENT, UNREADABLE, "")  # "": this rank read its part


# --- progress and hang verdicts --------------------------------------------------------------
# Phases in the order a step goes through them. "collective" is an explicit collective of the
# training step (loss or grad-norm all-reduce); collectives issued inside a checkpoint save or
# an eval belong to those phases, so their waits get the long allowance.
PHASES = ("data", "forward", "backward", "collective", "optimizer", "eval", "checkpoint")
LONG_PHASES = ("eval", "checkpoint")
_ORDER = {p: i for i, p in enumerate(PHASES)}


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a rank is. Sent as {"type": "progress", "rank", "round", **fields}.

    `seq`: collectives this rank had issued when it entered the phase (the sum of
    `_get_sequence_number_for_group()` over the process groups it uses; equal on every rank
    of an SPMD program at the same point). `since`: time.monotonic() when it entered the
    phase; the clock is shared by every process of a host. `op`: the collective's name in
    the "collective" phase, for the report.
    """
    step: int
    phase: str
    seq: int
    since: float
    op: str = ""

    def __post_init__(self):
        if self.phase not in _ORDER:
            raise ValueError(f"unknown phase {self.phase!r} (known: {', '.join(PHASES)})")

    def to_message(self, *, rank: int, round: int) -> dict:
        return {"type": "progress", "rank": rank, "round": round, "step": self.step,
                "phase": self.phase, "seq": self.seq, "since": self.since, "op": self.op}

    @classmethod
    def from_message(cls, msg: Mapping) -> Progress:
        """ValueError (or KeyError / TypeError) on a malformed message."""
        # A finite time, or the agent's hang report would carry a NaN the daemon refuses.
        return cls(step=int(msg["step"]), phase=str(msg["phase"]), seq=int(msg["seq"]),
                   since=_seconds(float(msg["since"]), "since"), op=str(msg.get("op", "")))


@dataclass(frozen=True, slots=True)
class Position:
    """A rank's place in the program as a verdict reports it (JSON-able, host-independent)."""
    step: int
    phase: str
    seq: int
    stalled_s: float
    op: str = ""

    def key(self) -> tuple[int, int, int]:
        return (self.step, self.seq, _ORDER[self.phase])

    def describe(self) -> str:
        where = f"in {self.op[:80] or 'a collective'}" if self.phase == "collective" \
            else f"in {self.phase}"
        return f"{where} at step {self.step} after {self.seq} collectives"


# How long an agent gives its ranks to answer for their stacks and flight records on a hang. A
# stopped rank answers neither, so a node holding one reports only this long after detecting:
# the daemon's wait for the other nodes' reports is longer (lazarus.daemon.decide).
STACK_CAPTURE_S = 3.0


@dataclass(frozen=True, slots=True)
class HangVerdict:
    culprits: tuple[int, ...]        # global ranks named as the cause; () = none local
    reason: str
    stalled_s: float                 # longest time without progress among the ranks
    timeout_s: float                 # the allowance that ran out
    positions: dict[int, Position] = field(default_factory=dict)  # every rank observed
    # Ranks whose process is not running (stopped, stuck in the kernel, silent to the stack
    # dump: lazarus.agent.frozen) -> why. They are the culprits, whatever the positions say.
    frozen: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"culprits": list(self.culprits), "reason": self.reason,
                "stalled_s": self.stalled_s, "timeout_s": self.timeout_s,
                "positions": {str(r): {"step": p.step, "phase": p.phase, "seq": p.seq,
                                       "stalled_s": p.stalled_s, "op": p.op}
                              for r, p in self.positions.items()},
                "frozen": {str(r): why for r, why in self.frozen.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> HangVerdict:
        """ValueError (or KeyError / TypeError) on a report not as `to_dict` writes it: the
        daemon orders ranks by these positions, so each is checked, not converted."""
        positions = d["positions"]
        if not isinstance(positions, Mapping) or not positions:
            raise ValueError("a hang report names the positions of its ranks")
        return cls(culprits=tuple(_typed(r, int, "culprit") for r in _typed(d["culprits"], list,
                                                                            "culprits")),
                   reason=_typed(d["reason"], str, "reason"),
                   stalled_s=_seconds(d["stalled_s"], "stalled_s"),
                   timeout_s=_seconds(d["timeout_s"], "timeout_s"),
                   positions={int(r): _position(p) for r, p in positions.items()},
                   frozen={_typed_rank(r): _typed(why, str, "frozen")
                           for r, why in _typed(d.get("frozen") or {}, Mapping,
                                                "frozen").items()})


def _typed_rank(r) -> int:
    if isinstance(r, bool) or not isinstance(r, (int, str)):
        raise TypeError(f"rank: {r!r:.80}")
    return int(r)


def _typed(value, kind, what: str):
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{what}: {value!r:.80}")
    return value


def _seconds(value, what: str) -> float:
    if not math.isfinite(_typed(value, (int, float), what)):
        raise ValueError(f"{what}: {value!r} is no number of seconds")
    return float(value)


def _position(p: Mapping) -> Position:
    if not isinstance(p, Mapping) or p.get("phase") not in _ORDER:
        raise ValueError(f"not a rank's position: {p!r:.80}")
    return Position(step=_typed(p["step"], int, "step"), phase=p["phase"],
                    seq=_typed(p["seq"], int, "seq"),
                    stalled_s=_seconds(p["stalled_s"], "stalled_s"),
                    op=_typed(p.get("op", ""), str, "op"))
