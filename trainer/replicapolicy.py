"""The per-step decisions of replica groups (docs/replicas.md): which replicas take part in a
step, which of them heal first and from whom, and which shares of the global batch each
takes. Pure: lazarus.trainer.replicagroup gathers the facts and acts on the answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

BATCH_POLICIES = ("drop", "respread")


@dataclass(frozen=True, slots=True)
class Quorum:
    """Who takes part in step `step` (its `attempt`-th try: a collective that failed is
    retried at the same step without the replicas that broke it)."""
    step: int
    attempt: int
    members: tuple[int, ...]   # replica ids, sorted
    healing: tuple[int, ...]   # members that first fetch the state of `source`
    source: int | None         # a member that took part in the step before

    @property
    def key(self) -> str:
        return f"{self.step}.{self.attempt}"

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "attempt": self.attempt, "members": self.members,
                           "healing": self.healing, "source": self.source})

    @classmethod
    def from_json(cls, raw: str | bytes) -> "Quorum":
        d = json.loads(raw)
        return cls(step=int(d["step"]), attempt=int(d["attempt"]),
                   members=tuple(int(m) for m in d["members"]),
                   healing=tuple(int(m) for m in d["healing"]),
                   source=None if d["source"] is None else int(d["source"]))


def decide(*, step: int, attempt: int, expected: set[int], arrived: set[int],
           joiners: set[int], gone: set[int], min_replicas: int) -> Quorum | None:
    """The quorum of (step, attempt), or None to wait on.

    `expected`: the replicas of the last quorum (all of them at the first step); `arrived`:
    those that asked for this one; `joiners`: restarted replicas waiting to heal; `gone`:
    replicas whose leader stopped beating. Every expected replica is waited for, however
    slow, unless it is gone: a slow replica is not a lost one. Then the quorum is whoever
    arrived, if they are at least `min_replicas`. Joiners come in only beside a replica that
    holds the current state, and never count toward `min_replicas`. An expected replica that
    waits to join is a new start of it: its last one is gone, whatever its heartbeat (which
    the new start beats), and nobody else may say so (a lost node's ranks say nothing).
    """
    gone = gone | (joiners - arrived)
    if not arrived or not expected <= arrived | gone or len(arrived) < min_replicas:
        return None
    healing = sorted(joiners - arrived)
    return Quorum(step=step, attempt=attempt, members=tuple(sorted(arrived | set(healing))),
                  healing=tuple(healing), source=min(arrived))


class Silence:
    """Which replicas have gone silent: each one's heartbeat count as one observer saw it
    change, timed on that observer's clock alone (no clock is compared across hosts)."""

    def __init__(self, wait_s: float, start_wait_s: float):
        self.wait_s, self.start_wait_s = wait_s, start_wait_s
        self._seen: dict[int, tuple[int, float]] = {}  # replica -> (count, when it last moved)

    def gone(self, replica: int, count: int, now: float, since: float) -> bool:
        """Whether `replica`, whose count reads `count` at `now`, is gone: unchanged for
        wait_s; or, never having beaten (0), for start_wait_s since `since` (when this
        observer began to wait)."""
        seen = self._seen.get(replica)
        if seen is None or seen[0] != count:
            seen = self._seen[replica] = (count, now if count else since)
        return now - seen[1] > (self.wait_s if seen[0] else self.start_wait_s)


def shares(members: tuple[int, ...], replicas: int, policy: str) -> dict[int, tuple[int, ...]]:
    """The shares of the global batch (one per replica: share r is replica r's when all are
    present) each member computes in a step: "drop" leaves a missing replica's share out
    (fewer samples that step), "respread" hands it to the members in turn (the same samples,
    by gradient accumulation, at the cost of a longer step)."""
    if policy not in BATCH_POLICIES:
        raise ValueError(f"batch policy must be one of {BATCH_POLICIES}, got {policy!r}")
    if not members or not set(members) <= set(range(replicas)):
        raise ValueError(f"members {members} are not a non-empty subset of 0..{replicas - 1}")
    out = {m: [m] for m in members}
    if policy == "respread":
        missing = [r for r in range(replicas) if r not in out]
        order = sorted(members)
        for i, r in enumerate(missing):
            out[order[i % len(order)]].append(r)
    return {m: tuple(v) for m, v in out.items()}


def divisor(assigned: dict[int, tuple[int, ...]]) -> int:
    """What the cross-replica sum of gradients is divided by: the shares computed in the step
    (each member's gradient is the sum of its shares' mean gradients)."""
    return sum(len(v) for v in assigned.values())
