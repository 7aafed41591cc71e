"""A restore that failed: the checkpoint's fault or a node's? Pure policy.

Every rank of a round that cannot restore its checkpoint exits with
exitcodes.BAD_CHECKPOINT and tells its agent what it found from where it stands
(lazarus.core.contract: corrupt, missing, unreadable, or "" when it read its part and another
rank did not); the agent keeps its node's most telling finding (NodeStatus.restore_failed).
Comparing the nodes' findings:

- a file that fails its checksum or size, or a manifest that cannot be parsed, is wrong with
  the checkpoint: it is condemned, and the event names the file;
- a checkpoint some nodes cannot see or read while others read their part is those nodes'
  fault (a missing mount, a permission): they are cordoned, the checkpoint is kept, and the
  next round restores it without them;
- a checkpoint that every node misses, in a checkpoint root that holds the job's other
  checkpoints, is gone: condemned;
- storage that no node can read (the root absent or empty everywhere, permission denied
  everywhere)
  says nothing against this checkpoint more than against the older ones: it is kept, and the
  run retries it (each try a restart) until the storage is back or max_restarts runs out.

A node that failed without saying why (a worker from before these reports) counts as saying
the checkpoint cannot be restored, as it used to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazarus.core.contract import ABSENT, CORRUPT, UNREADABLE


@dataclass(frozen=True, slots=True)
class Verdict:
    condemn: str = ""                    # why the checkpoint is condemned ("": it is kept)
    cordon: dict[str, str] = field(default_factory=dict)  # node -> why it cannot read it
    storage: str = ""                    # no node can read the storage: keep it and retry


def judge(reports: dict[str, dict | None]) -> Verdict:
    """`reports`: each member's finding ({"kind", "reason"}), None for a member that failed
    without one (or not at all)."""
    said = {n: r for n, r in reports.items() if isinstance(r, dict)
            and r.get("kind") in (CORRUPT, ABSENT, UNREADABLE, "")}
    corrupt = [r for _, r in sorted(said.items()) if r["kind"] == CORRUPT]
    if corrupt:
        return Verdict(condemn=_why(corrupt[0]))
    blind = {n: _why(r) for n, r in sorted(said.items()) if r["kind"] in (ABSENT, UNREADABLE)}
    seeing = [n for n, r in said.items() if r["kind"] == ""]
    if blind and seeing:
        return Verdict(cordon=blind)
    if blind and all(said[n]["kind"] == ABSENT for n in blind):
        first = next(iter(blind.values()))
        return Verdict(condemn=f"{first} (on every node)" if len(blind) > 1 else first)
    if blind:
        return Verdict(storage="; ".join(f"{n}: {why}" for n, why in blind.items()))
    # Nobody said what is wrong (workers that do not report findings): as before them.
    return Verdict(condemn=next((_why(r) for r in said.values() if r.get("reason")),
                                "no reason reported (see the worker logs)"))


def _why(report: dict) -> str:
    return str(report.get("reason") or report.get("kind") or "no reason given")
