"""The agent's policy, pure: what a pass of its loop does about what it observes. Nothing here
reads etcd, a process, a socket or the clock; the loop (lazarus.agent.service) observes and
the executors (lazarus.agent.rounds, lazarus.agent.hangreport) act.

A pass observes in two steps, and decides after each:
- its ranks and the hang detector -> `hang`: report a hang, or withdraw the report. First,
  because it needs no etcd (a hang found during an outage is written once etcd is back), and
  because a hung round's stacks must be taken before anything kills its ranks;
- then, when a reconcile is due, its assignment as read from etcd (run/status and the round
  record) -> `converge`: stop the ranks of a round that is over (less the survivors of a lost
  peer, kept for the next round: docs/inplace.md), tell tier 0 the current round, start this
  node's ranks of it -- or, in a replica job, carry the ranks of a replica the new round
  leaves untouched on into it (docs/replicas.md).
`status_due` is the node status's write rule (docs/architecture.md, "Write budget").

Level-triggered like the daemon: each pass looks at the whole assignment, and the agent
obeys the round record; it never decides membership.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazarus.core.contract import HangVerdict
from lazarus.core.records import RECOVERING, RENDEZVOUS, RUNNING, RoundRecord, RunStatus


@dataclass(frozen=True, slots=True)
class Local:
    """This node's ranks as the agent last polled them."""
    round: int | None = None  # the round they belong to; None: no round's ranks here
    alive: bool = False       # one of them has not exited
    # local ranks that survived a lost peer and wait for the next round in their process
    survivors: frozenset[int] = frozenset()
    kept: bool = False        # survivors of a stopped round wait for this node's next launch
    waiting: bool = False     # some ranks alive have not survived (yet): they run, or hang
    over_s: float = 0.0       # how long the agent has seen their round over
    # the round they were launched in, when a replica round carried them on into `round`
    # (docs/replicas.md); None: the same as `round`
    rank_round: int | None = None
    succeeded: bool = False   # every one of them finished its steps (exit 0)

    @property
    def launched(self) -> int | None:
        return self.round if self.rank_round is None else self.rank_round


# How long the ranks of a fault's victim node may take to notice that they lost a peer, once
# the round is over: a crashed rank's peers notice at their next collective, which may be a
# forward and backward away (the daemon can be quicker); a hang's victims when the culprit's
# node kills its ranks on seeing the round end, which resets their sockets and fails the
# victims' collectives (gloo's abort does not cancel one: docs/inplace.md).
RELEASE_S = 5.0
# The faults that end the culprit's processes, and so release their peers elsewhere. Not a
# lost node: its peers noticed a dead one long before its lease ran out, and a node cut off
# from etcd alone trains on with them -- held, they would train and snapshot past the step
# the next round restores (tests/e2e/test_partition.py).
RELEASING = frozenset({"worker_crash", "hang", "gpu_failed", "peer_lost"})


# -- actions ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StopRound:
    """End this node's ranks of `round`: the round is over and its state is in checkpoints.
    Kill them, less the survivors in `keep` (local ranks), kept for the next round's launch
    (lazarus.trainer.inplace)."""
    round: int
    why: str  # for the log
    keep: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class DropKept:
    """Kill the survivors, kept or still in their round: no round of this node will take
    them."""
    why: str


@dataclass(frozen=True, slots=True)
class SeeRound:
    """Tell tier 0 the current round (its ring peer, the snapshots still of use), and the
    worker zygote its job, to rehearse (lazarus.agent.workers.Workers.rehearse)."""
    record: RoundRecord


@dataclass(frozen=True, slots=True)
class Launch:
    """Start this node's ranks of the round."""
    record: RoundRecord


@dataclass(frozen=True, slots=True)
class CarryOn:
    """This node's ranks belong to a replica the round leaves untouched: they go on, in the
    world of the round they were launched in, and are the round's from now on (its node
    status says so). Nothing is stopped or started."""
    record: RoundRecord


@dataclass(frozen=True, slots=True)
class ReleaseVictims:
    """Tell this node's ranks of `round` that a peer elsewhere is gone: each aborts its
    process groups (on NCCL: over NVLink or shared memory a collective waiting on a dead or
    frozen peer never notices by itself) and survives (docs/inplace.md)."""
    round: int


@dataclass(frozen=True, slots=True)
class Refill:
    """Top up the warm parked workers."""


@dataclass(frozen=True, slots=True)
class ReportHang:
    """Take the ranks' stacks and report the hang in the node status."""
    verdict: HangVerdict


@dataclass(frozen=True, slots=True)
class WithdrawHang:
    """The ranks moved again: drop the report."""
    round: int


# -- decisions -------------------------------------------------------------------------------
def hang(local: Local, verdict: HangVerdict | None, *, reported: bool) -> list:
    """`verdict`: the hang detector's, asked only while the ranks are alive. A report stays
    once made, until the ranks move again: they were waiting for a peer on another node that
    was in a checkpoint or an eval, which that node's status says (the daemon waits with it).
    Ranks that exited keep their round's report. Survivors of a lost peer wait, by design,
    for the next round: not a hang."""
    if not local.alive or local.survivors:
        return []
    if reported:
        return [WithdrawHang(local.round)] if verdict is None else []
    return [ReportHang(verdict)] if verdict is not None else []


def converge(node: str, status: RunStatus | None, rec: RoundRecord | None,
             local: Local) -> list:
    """The actions that bring this node's ranks to its assignment, in order: the old
    round's ranks are stopped before the new round's start (lazarus.agent.workers runs one
    round at a time), and the parked workers are topped up at once, even while a round
    starts: the next fault may come any second, and a parked worker still importing torch
    then is no better than a cold start."""
    live = status is not None and status.state in (RENDEZVOUS, RUNNING)
    current = rec if rec is not None and status is not None and rec.round == status.round \
        else None
    # A survivor is of use while the run goes on, or recovers into its next round, and the
    # node may be in that round (its record may not be read yet); the launch of that round
    # takes it or lets it go.
    going_on = live or (status is not None and status.state == RECOVERING)
    useful = going_on and (current is None or node in current.members)
    if live and current is not None and _carried(node, current, local):
        # Before the stop and release below: the round that ends is the ranks' own, but
        # their replica's world is not (the fault was another replica's).
        return [SeeRound(current)] + ([CarryOn(current)] if local.round != current.round
                                      else []) + [Refill()]
    if (live and current is None and rec is not None and rec.replicas > 1 and local.alive
            and status.round > rec.round):
        # The status of a newer round is read, its record not yet (one transaction wrote
        # both): whether it carries these ranks on is in the record. Stopped or told their
        # peer is gone meanwhile, a carried replica's ranks would be lost for nothing.
        return [Refill()]
    actions: list = []
    running = local.round
    kept = local.kept
    if running is not None:
        newer = status is not None and status.round != running
        replicas = rec is not None and rec.replicas > 1
        if (newer or (not live and local.alive)) and useful and local.waiting \
                and local.over_s < RELEASE_S and _victim(node, status, running,
                                                         replicas=replicas):
            # Not killed yet: these ranks lost a peer on another node, or wait in a collective
            # for a hang's culprit there, and survive once they notice -- told, so that they
            # need not notice by themselves. Nothing starts meanwhile.
            return [ReleaseVictims(running), Refill()]
        if newer or (not live and local.alive):
            keep = local.survivors if useful else frozenset()
            actions.append(StopRound(running, f"round {status.round} is current" if newer else
                                     f"run is {status.state if status else 'gone'}", keep))
            running, kept = None, kept or bool(keep)
    if kept and not useful:
        actions.append(DropKept(f"run is {status.state if status else 'gone'}"
                                if not going_on else "this node is not in the current round"))
    if current is not None:
        actions.append(SeeRound(current))
        if live and node in current.members and running != current.round:
            actions.append(Launch(current))
    actions.append(Refill())
    return actions


def cut_off(local: Local, away_s: float, lease_ttl_s: float) -> list:
    """What a pass does while etcd is away for `away_s`: past the lease TTL the daemon has
    declared this node lost and gone on without it, so its survivors will never be handed a
    round: let them go (their device with them). Ranks that train are left alone: an outage
    of etcd itself stops nobody's training."""
    if away_s > lease_ttl_s and (local.survivors or local.kept):
        return [DropKept(f"etcd away {away_s:.0f} s, past the lease TTL: this node is "
                         "lost to the run")]
    return []


def _carried(node: str, rec: RoundRecord, local: Local) -> bool:
    """Whether this node's ranks are alive in a replica that `rec` carries on from the round
    they were launched in (docs/replicas.md): no other ranks of that replica are started."""
    # Ranks that finished their steps are carried too: relabelled, they say so in the new
    # round, and the run ends on them (lazarus.daemon.replicaround.finished) instead of a
    # second start of a replica with nobody to heal from.
    return (local.alive or local.succeeded) and rec.carries(node, local.launched)


def _victim(node: str, status: RunStatus | None, round_: int, *, replicas: bool = False
            ) -> bool:
    """Whether `round_` ended on a fault that ends processes (RELEASING) on other nodes than
    this one: this node's ranks are its victims, not its culprits. A worker crash's own node
    too: the rank that failed is gone, and the node's other ranks wait on it as any peer
    does (on NCCL, over NVLink, they never notice by themselves: killed, every one of them
    would start anew). Whether the node stays in the run is the daemon's to say; the next
    round's record that leaves it out lets them go. Not in a job of `replicas`: a replica's
    ranks never survive in place (it restarts whole and heals, docs/replicas.md), and its
    incident names the replicas only once the daemon has decided."""
    incident = status.incident if status is not None else None
    if not isinstance(incident, dict) or incident.get("kind") not in RELEASING \
            or incident.get("round") != round_:
        return False
    culprits = str(incident.get("culprit", "")).split(",")
    return node not in culprits or (incident.get("kind") == "worker_crash" and not replicas
                                    and not incident.get("replicas"))


def status_due(now: float, state: tuple, step: int, *, published_state: tuple | None,
               published_step: int, published_at: float, period_s: float,
               force: bool = False) -> bool:
    """Whether to write the node status: at once on a change of `state` (workers, health, a
    hang, a long phase, a spike), else at most once a `period_s` while the step moves.
    Liveness is the lease alone; nothing reads the age of a status as a sign of life."""
    return force or state != published_state or (
        step != published_step and now - published_at >= period_s)
