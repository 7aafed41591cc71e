"""Ranks a SIGKILL cannot end, as pure policy (docs/architecture.md, "Failure classes").

An agent that stops its ranks and finds one still there after its SIGKILL -- its main thread
in the kernel, on a mount that never answers (an NFS hard mount, a FUSE server that took a
request and never answers) -- sets it aside and says so in its node status
(lazarus.agent.workers.Workers.set_aside). Such a node cannot serve: the process may still
hold its GPU and its memory, and the mount its ranks read is gone. It is cordoned with the
reason, as an operator cordons, so the cordon stays until an operator uncordons the node --
after a reboot, the only thing that ends such a process. A member of the live round is also
replaced, as a lost node is (decide._check_faults: a spare, else a shrink to `min_nodes`);
`respond` cordons any other node, whatever the run does.
"""

from __future__ import annotations

from lazarus.daemon.actions import Cordon, Decision, Emit
from lazarus.daemon.view import ClusterView

KIND = "unkillable_rank"
# What a reason says of one node's set-aside processes: the first, and how many more. A
# cordon's reason is kept up to view.MAX_CORDON_REASON (300): the advice after it must fit.
SAID_CHARS = 220
# Nodes an event names, and processes a node's entries keep: what an agent wrote is bounded
# here too, whatever it wrote.
NODES_SAID = 3
ENTRIES_KEPT = 8
WHY_CHARS = 400


def stuck(view: ClusterView, node: str) -> list[dict]:
    """The node's processes that a SIGKILL could not end, as its agent said them: {"pid",
    "rank" (None: a worker of no round, parked or let go), "why"}; what is not
    such an entry is left out."""
    ns = view.node_status.get(node)
    out = []
    for entry in (ns.unkillable[:ENTRIES_KEPT * 4] if ns is not None else ()):
        pid, rank, why = entry.get("pid"), entry.get("rank"), entry.get("why")
        if not _int(pid) or (rank is not None and not _int(rank)):
            continue
        out.append({"pid": pid, "rank": rank,
                    "why": why[:WHY_CHARS] if isinstance(why, str) else ""})
    return out[:ENTRIES_KEPT]


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def said(entries: list[dict]) -> str:
    """"rank 1 (pid 4242) stuck in the kernel (wchan folio_wait_bit_common, opening
    /mnt/data/shard-3.bin); SIGKILL cannot end it", and "; N more" when there are."""
    first = entries[0]
    who = (f"rank {first['rank']}" if first["rank"] is not None else "a worker") + \
        f" (pid {first['pid']})"
    text = f"{who} {' '.join((first['why'] or 'still there after its SIGKILL').split())}"
    more = f"; {len(entries) - 1} more" if len(entries) > 1 else ""
    if len(text) + len(more) > SAID_CHARS:
        text = text[:SAID_CHARS - len(more) - 3] + "..."
    return text + more


def advice(node: str) -> str:
    return f"reboot the node, then `lazarus uncordon {node}`"


def cannot_serve(stuck: dict[str, list[dict]]) -> str:
    """What an event says of the nodes `stuck` (node -> its entries): "n1 cannot serve: rank 1
    (pid 4242) ...; cordoned (reboot the node, then `lazarus uncordon n1`)"; a few nodes
    named, the others counted."""
    named = list(stuck)[:NODES_SAID]
    text = "; ".join(f"{n} cannot serve: {said(stuck[n])}" for n in named)
    if len(stuck) > len(named):
        text += f"; {len(stuck) - len(named)} more node(s) too"
    how = (advice(named[0]) if len(stuck) == 1
           else "reboot each, then `lazarus uncordon` it")
    return f"{text}; cordoned ({how})"


def cordon(node: str, entries: list[dict]) -> Cordon:
    """The cordon, with what `lazarus nodes` shows: what cannot end and what to do."""
    return Cordon(node, reason=f"{said(entries)}; {advice(node)}")


def respond(view: ClusterView, skip: frozenset[str] | set[str] = frozenset()) -> Decision | None:
    """Cordon each registered node not yet cordoned whose agent set aside a process SIGKILL
    cannot end; `skip`: the live round's members, whose cordon comes with their replacement
    (decide._check_faults), in one event."""
    actions: list = []
    for node in sorted(view.nodes):
        if node in view.cordoned or node in skip:
            continue
        entries = stuck(view, node)
        if not entries:
            continue
        msg = cannot_serve({node: entries})
        actions += [cordon(node, entries),
                    Emit(KIND, msg, {"node": node, "culprit": node, "processes": entries})]
    if not actions:
        return None
    nodes = [a.node for a in actions if isinstance(a, Cordon)]
    return Decision(actions, f"a process SIGKILL cannot end on {', '.join(nodes)}: cordoned")
