"""What decide() may ask for. The executor turns a Decision into one fenced transaction."""

from __future__ import annotations

from dataclasses import dataclass, field

from lazarus.core.jobspec import JobSpec
from lazarus.core.records import CheckpointRecord, RoundRecord, RunStatus


@dataclass(frozen=True, slots=True)
class AcceptJob:
    job: JobSpec


@dataclass(frozen=True, slots=True)
class RejectJob:
    """A submission that cannot run: drop it (the event says why)."""
    job_id: str


@dataclass(frozen=True, slots=True)
class SetStatus:
    status: RunStatus


@dataclass(frozen=True, slots=True)
class StartRound:
    record: RoundRecord


@dataclass(frozen=True, slots=True)
class Emit:
    kind: str
    message: str
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestCheckpoint:
    """Ask every rank for a checkpoint now (passed on by the agents at the next step)."""
    id: str


@dataclass(frozen=True, slots=True)
class Cordon:
    node: str
    reason: str = ""  # kept in the cordon key for the operator
    by: str = ""         # "preflight": lifted by the leader when a preflight passes again


@dataclass(frozen=True, slots=True)
class Uncordon:
    """Lift a cordon the leader made for a failed preflight (never an operator's)."""
    node: str


@dataclass(frozen=True, slots=True)
class RequestDrain:
    """Start a planned swap of a node (as `lazarus drain` would): checkpoint, then replace it."""
    node: str
    reason: str


@dataclass(frozen=True, slots=True)
class ClearCommand:
    """The operator command is done: delete its key ("drain/<node>", "cancel")."""
    name: str


@dataclass(frozen=True, slots=True)
class MarkCheckpoint:
    """Rewrite a checkpoint's registry record as good or not (rollback abandons some)."""
    checkpoint: CheckpointRecord
    good: bool


@dataclass(frozen=True, slots=True)
class AdoptClaim:
    """Make a checkpoint claim the step's record, and delete the claim."""
    key: str
    record: CheckpointRecord


@dataclass(frozen=True, slots=True)
class DropClaim:
    """Delete a checkpoint claim that is not adopted (an Emit says why)."""
    key: str


@dataclass(frozen=True, slots=True)
class DropClaimsBelow:
    """Delete every checkpoint claim whose key sorts before `key`: the surplus of a flood."""
    key: str


@dataclass(frozen=True, slots=True)
class Decision:
    """`awaiting`: nodes whose next status report is what this (empty) decision waits for.
    The loop passes again as soon as every one of them has reported, instead of at its paced
    rate (a recovery waiting for the survivors' in-memory copies: docs/inplace.md)."""
    actions: list
    reason: str
    awaiting: tuple[str, ...] = ()
