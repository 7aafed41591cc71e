"""Naming the rank that others wait for, from where every rank is (`Position`s).

An agent names a culprit among its own ranks; the daemon combines every agent's verdict to
name the node when the culprit is on another node than the ranks that noticed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lazarus.core.contract import HangVerdict, Position


def name_culprits(positions: Mapping[int, Position]) -> tuple[tuple[int, ...], str]:
    """(culprit ranks, reason): the ranks furthest behind, or none when all are level."""
    keys = {rank: pos.key() for rank, pos in positions.items()}
    lowest = min(keys.values())
    behind = tuple(sorted(r for r, k in keys.items() if k == lowest))
    ahead = sorted(r for r in keys if r not in behind)
    if not ahead:
        pos = positions[behind[0]]
        return (), (f"{_who(behind)} all stalled {pos.describe()}: "
                    "the rank they wait for is not among them")
    lead = positions[ahead[0]]
    waiting = [r for r in ahead if positions[r].phase == "collective"]
    culprit = positions[behind[0]]
    others = (f"{_who(waiting)} wait{'s' if len(waiting) == 1 else ''} {lead.describe()}"
              if waiting else f"{_who(ahead)} got further ({lead.describe()})")
    return behind, (f"{_who(behind)} stuck {culprit.describe()} for "
                    f"{culprit.stalled_s:.1f} s; {others}")


def _who(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


@dataclass(frozen=True, slots=True)
class ClusterHang:
    culprit_ranks: tuple[int, ...]
    culprit_nodes: tuple[str, ...]
    reason: str


def combine(verdicts: Mapping[str, HangVerdict]) -> ClusterHang:
    """Name the culprit node from the hang reports of several agents (node -> verdict).

    Every agent sees only its own ranks; together their positions show who is behind. A node
    whose agent has not reported yet is not blamed: wait a moment for its report (its ranks
    stall too in a real hang), or act on what is here.
    """
    assert verdicts, "combine needs at least one report"
    positions: dict[int, Position] = {}
    node_of: dict[int, str] = {}
    frozen: dict[int, str] = {}
    for node, verdict in verdicts.items():
        for rank, pos in verdict.positions.items():
            positions[rank] = pos
            node_of[rank] = node
        for rank, why in verdict.frozen.items():
            frozen[rank] = why
            node_of[rank] = node
    if frozen:
        # A process that does not run is the cause, wherever the others stopped: they wait
        # for it (and a rank frozen mid-collective sits level with them).
        ranks = tuple(sorted(frozen))
        nodes = tuple(sorted({node_of[r] for r in ranks}))
        return ClusterHang(culprit_ranks=ranks, culprit_nodes=nodes, reason=(
            f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}: " + "; ".join(
                f"rank {r} is frozen ({frozen[r]})" for r in ranks)))
    culprits, reason = name_culprits(positions)
    nodes = tuple(sorted({node_of[r] for r in culprits}))
    if culprits:
        reason = f"node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}: {reason}"
    return ClusterHang(culprit_ranks=culprits, culprit_nodes=nodes, reason=reason)
