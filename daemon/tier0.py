"""Which tier a round restores from: the newest step of which every shard can be had, from
memory (tier 0: a node's own snapshots or its ring predecessor's copies, as the node status
reports them) or from storage (tier 1, the checkpoint records). Pure.

A tier-0 step counts only when every rank of the new round's mesh has a copy of it on a live
node, taken at the same world size (a shard is one rank's piece of one mesh). Each rank takes
its copy from the node that runs it when that node has one, else from any node that holds one
(a lost node's ranks: from its peer, for the spare that takes its place).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The label of a tier-0 restore in run/status (`restore`), events and the incident of a
# restore that failed.
LABEL = "memory (tier 0) step"
# A recovery waits at most this long for every surviving member to report its copies as
# they were at the fault (their ranks stop, and their agents write a status, within a second).
FRESH_WAIT_S = 3.0


@dataclass(frozen=True, slots=True)
class Tier0Choice:
    step: int
    sources: dict[int, str]  # global rank -> node to take its copy from

    def to_record(self) -> dict:
        return {"step": self.step, "sources": {str(r): n for r, n in self.sources.items()}}

    @property
    def label(self) -> str:
        return f"{LABEL} {self.step}"


def _steps(value) -> list[int]:
    if not isinstance(value, list):
        return []
    return [s for s in value if isinstance(s, int) and not isinstance(s, bool) and s > 0]


def newest_in_memory(holdings: Mapping[str, object], *, job_id: str, world_size: int,
                     members: list[str], nproc: int) -> Tier0Choice | None:
    """The newest step every rank of a round of `members` (in rank order, `nproc` ranks each)
    can restore from memory, with the node to take each rank's copy from; None if there is
    none. `holdings`: live node -> its status's `tier0` report (garbage counts as nothing)."""
    held: dict[int, dict[int, list[str]]] = {}
    for node in sorted(holdings):
        h = holdings[node]
        if not isinstance(h, Mapping) or h.get("job") != job_id or h.get("world") != world_size \
                or not isinstance(h.get("ranks"), Mapping):
            continue
        for r, steps in h["ranks"].items():
            try:
                rank = int(r)
            except (TypeError, ValueError):
                continue
            if 0 <= rank < world_size:
                for step in _steps(steps):
                    held.setdefault(step, {}).setdefault(rank, []).append(node)
    for step in sorted(held, reverse=True):
        by_rank = held[step]
        if len(by_rank) < world_size:
            continue
        sources = {}
        for rank in range(world_size):
            runner = members[rank // nproc] if rank // nproc < len(members) else None
            sources[rank] = runner if runner in by_rank[rank] else by_rank[rank][0]
        return Tier0Choice(step, sources)
    return None


def choose(*, tier0: Tier0Choice | None, tier1_step: int | None, tier0_failed: bool
           ) -> Tier0Choice | None:
    """The tier-0 step when it is at least as new as storage's (memory is faster to load),
    unless a restore from memory just failed: then storage."""
    if tier0 is None or tier0_failed:
        return None
    return tier0 if tier1_step is None or tier0.step >= tier1_step else None


def failed_before(incident: Mapping | None) -> bool:
    """Whether the recovery under way is from a restore from memory that failed."""
    return (isinstance(incident, Mapping) and incident.get("kind") == "bad_checkpoint"
            and str(incident.get("culprit", "")).startswith(LABEL))


def stale(statuses: Mapping[str, tuple[float, bool]], fault_at: float) -> list[str]:
    """Members whose last status (updated_at, holds tier-0 copies) predates the fault: what
    they hold may have moved on since. Nodes without copies are not waited for."""
    return sorted(n for n, (updated_at, holds) in statuses.items()
                  if holds and updated_at < fault_at)
