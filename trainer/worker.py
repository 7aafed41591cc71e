"""One trainer rank: what `lazarus train` spawns locally and the node agent launches (or keeps
parked, warm) on a cluster.

The assignment says who this rank is in which rendezvous round and where the round's store
is. Store keys are namespaced by round: a restarted worker must never read a dead round's
entries (on a shared store that makes gloo connect to dead peers or hang).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta

from lazarus.core import exitcodes
from lazarus.core.contract import (ASSIGNMENT_ENV, CORRUPT, PG_TIMEOUT_ENV, STACKS_ENV,
                                   WorkerAssignment)
from lazarus.core.errors import CheckpointError, JobRefused, RestoreFailed, UserError
from lazarus.core.trainconfig import TrainConfig
from lazarus.trainer import exitnote, glooinit, inplace
from lazarus.trainer import hooks as phase_hooks
from lazarus.trainer.rankprocess import RankProcess, this_process
from lazarus.trainer.rankrun import agent_store
from lazarus.trainer.startcost import StartCost

# A hand-over longer than this is a clock stepped between the agent and the rank, not a wait.
HANDOVER_MAX_S = 600.0
# How long init waits for the store and for every peer of the round to show up.
STORE_TIMEOUT = timedelta(seconds=300)

def handover_s(issued_at: object, now: float | None = None) -> float:
    """Seconds since the agent handed the assignment over at `issued_at` (wall clock): 0 when
    it did not say (0, not a number) or the clocks disagree; at most HANDOVER_MAX_S."""
    if isinstance(issued_at, bool) or not isinstance(issued_at, (int, float)) or issued_at <= 0:
        return 0.0
    waited = (time.time() if now is None else now) - issued_at
    return waited if 0.0 <= waited <= HANDOVER_MAX_S else 0.0


def _pg_timeout() -> timedelta:
    spec = os.environ.get(PG_TIMEOUT_ENV)
    if not spec:
        return STORE_TIMEOUT
    try:
        seconds = float(spec)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise UserError(f"{PG_TIMEOUT_ENV}={spec!r} is not a positive number of seconds")
    return timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True)
class Survived:
    """A round this rank left on a lost peer, staying for the next one in its process
    (lazarus.trainer.inplace): `next` is that round's assignment."""
    next: WorkerAssignment


def run(assignment: WorkerAssignment, *, process: RankProcess | None = None,
        in_place: bool = False, cost: StartCost | None = None) -> int | Survived:
    """Run the rank's round: its exit code, or Survived when it survived a lost peer and
    stays for the next round in this process (lazarus.trainer.inplace). `process`: what the
    process carries from round to round (default: this process's); `in_place`: this process
    ran an earlier round already; `cost`: what this start costs the process, counted from
    when the assignment came (default: from here)."""
    import torch
    import torch.distributed as dist

    # here, as torch: the zygote runs this module before it imports torch (import_for_fork)
    from lazarus.trainer.device import backend_for, device_type, local_cuda_device
    from lazarus.trainer.session import connect
    from lazarus.trainer.train import train

    # Under TP the logits come back from a redistribute as a view; nothing modifies them in
    # place, so FSDP's warning about in-place ops on views does not apply.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    a = assignment
    # The start's clock runs from the agent's hand-over: what came before this line (a parked
    # worker still warming up when the round came, a survivor letting its last round go) is
    # part of the recovery too (StartTimes' "handover").
    handed = time.perf_counter()
    began = handed - handover_s(a.issued_at)
    if os.environ.get(STACKS_ENV):
        # The agent asks for our stacks (SIGUSR1) before it kills a hung round.
        from lazarus.trainer.flightrec import serve_flight_record
        from lazarus.trainer.stackdump import enable_stack_dumps
        enable_stack_dumps(os.environ[STACKS_ENV])
        # ... and its collectives' flight record, when a hang leaves that in doubt
        serve_flight_record(os.environ[STACKS_ENV])
    cfg = TrainConfig.from_dict(a.train)
    dp, tp = cfg.parallelism.dp, cfg.parallelism.tp
    if a.replicas < 1 or a.world_size % a.replicas:
        raise UserError(f"a world of {a.world_size} ranks cannot hold {a.replicas} equal "
                        f"replicas")
    replica, local, per = a.replica_place
    if a.replicas > 1 and dp * tp != per:
        raise UserError(f"mesh dp {dp} x tp {tp} = {dp * tp} ranks, but each of the "
                        f"{a.replicas} replicas of a world of {a.world_size} has {per}")
    if a.replicas == 1 and dp * tp != a.world_size:
        raise UserError(f"mesh dp {dp} x tp {tp} = {dp * tp} ranks, but the "
                        f"assignment's world size is {a.world_size}")
    hooks = phase_hooks.from_env()
    cost = cost or StartCost(a.store_port, a.round)
    hooks.add(cost.hook)
    if cfg.deterministic:
        # Read by cuBLAS when this process makes its handle: before any CUDA work.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = device_type()
    if device == "cuda":
        torch.cuda.set_device(local_cuda_device(a.local_rank))
    # What peers send through torch's object collectives (DCP's plans) is unpickled narrowly.
    from lazarus.trainer import peerpickle
    peerpickle.install()
    # Connected before the rendezvous: from here on a rank whose agent is gone for good stops
    # itself (lazarus.trainer.session), even while it waits for peers that never come.
    session = connect(rank=a.rank, round=a.round, socket_path=a.report_socket)
    # The store is needed until the groups' pairs connect, at their first collectives (made
    # on use, below): a group of a store whose agent restarted before then fails as a lost
    # peer would. The connection is the one rankrun.enter read the round's port through.
    store = agent_store(a.store_host, a.store_port, STORE_TIMEOUT)
    # Every gloo group of the round connects the pairs its collectives use, not a full mesh
    # each: what a survivor's rendezvous connects and reads stops growing with the world
    # (docs/scale.md).
    glooinit.on_use()
    place = _replica_place(a) if a.replicas > 1 else None
    if place is None:
        dist.init_process_group(backend_for(device),
                                store=dist.PrefixStore(f"lazarus/round/{a.round}", store),
                                rank=a.rank, world_size=a.world_size, timeout=_pg_timeout())
    else:
        # The replica's own world: an error in another replica's collectives never reaches it.
        dist.init_process_group(
            backend_for(device),
            store=dist.PrefixStore(f"lazarus/round/{a.round}/replica/{replica}", store),
            rank=local, world_size=per, timeout=_pg_timeout())
    try:
        try:
            train(cfg, session=session, process=process, restore=a.restore, hooks=hooks,
                  job_id=a.job_id,
                  snapshot=a.snapshot, snapshot_dir=a.snapshot_dir, round_=a.round,
                  allowed_roots=a.allowed_roots, began=began, handed=handed,
                  in_place=in_place, restore_step=a.restore_step, replica=place)
        except BaseException:
            if place is not None:
                # The other replicas go on at once, not after this one's silence.
                place.leave()
            raise
    except JobRefused as e:
        print(f"rank {a.rank} round {a.round}: {e}", file=sys.stderr, flush=True)
        session.refused(str(e))
        session.close()  # sends what is held before the exit
        exitnote.exit_now(exitcodes.REFUSED)
    except CheckpointError as e:
        # The daemon compares every node's finding: it condemns the checkpoint for what is
        # wrong with it, or cordons a node that alone cannot read it.
        print(f"rank {a.rank} round {a.round}: cannot restore: {e}", file=sys.stderr, flush=True)
        kind, own = ((e.kind, e.own) if isinstance(e, RestoreFailed) else (CORRUPT, str(e)))
        session.restore_failed(a.restore or "", kind=kind, reason=own or str(e))
        session.close()  # sends what is held before the exit
        exitnote.exit_now(exitcodes.BAD_CHECKPOINT)
    except Exception as e:
        if not inplace.lost_peer(a, e):
            raise
        # Not this rank's fault: say so in the exit code, so the daemon names the real culprit.
        # os._exit: tearing down a process group whose peer is gone can block.
        why = inplace.peer_gone(a, e)
        # A replica's rank never survives in place: its replica restarts and heals whole.
        if place is None and inplace.enabled(a):
            # The round's model and optimizer are referenced from train()'s frame through the
            # traceback: let them go, so that the survivor frees them while it waits.
            traceback.clear_frames(e.__traceback__)
            nxt = inplace.survive(a, session, session.last_step, why, own_sockets=True)
            if nxt is not None:
                return Survived(nxt)
        exitnote.exit_now(exitcodes.PEER_LOST)
    finally:
        session.close()
    dist.destroy_process_group()
    return 0


def _replica_place(a: WorkerAssignment):
    """This rank's place in a job of replica groups (docs/replicas.md): its quorum's store is
    on the store of the agent that hosts the round (members[0]'s, which every round of the
    replicas' epoch shares), under the epoch's namespace."""
    # here, as torch: the zygote runs this module before it imports torch (import_for_fork)
    from lazarus.trainer.replicagroup import ReplicaPlace, quorum_prefix, quorum_store, shard_store

    replica, local, _per = a.replica_place
    return ReplicaPlace(
        replica=replica, replicas=a.replicas,
        store=lambda: quorum_store(a.store_host, a.store_port, a.job_id, a.replica_epoch),
        shard_store=lambda quorum: shard_store(quorum, a.store_host, shard=local,
                                               prefix=quorum_prefix(a.job_id, a.replica_epoch)),
        # launched after the epoch's whole-world start: a restart of this replica, which
        # heals from a live one at its first quorum
        joining=a.round > a.replica_epoch)


def _warm_up() -> None:
    """Run once what a first step would otherwise pay for lazily: building a model on the meta
    device imports torch._dynamo (2-3 s here), and AdamW's first step and DCP's optimizer-state
    init initialise their kernels (about 1 s). Measured as most of a restart's cost."""
    import torch

    # here, as torch: the zygote runs this module before it imports torch (import_for_fork)
    from lazarus.trainer.models import Transformer, get_model_config

    with torch.device("meta"):
        Transformer(get_model_config("tiny"))
    model = Transformer(get_model_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=True)
    model(torch.zeros(1, 8, dtype=torch.long)).float().mean().backward()
    opt.step()


def _park() -> WorkerAssignment:
    # Pay for every heavy import now; promotion then costs only the rendezvous.
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import lazarus.trainer.train  # noqa: F401 -- now, not when promoted

    _warm_up()
    print(json.dumps({"event": "parked", "pid": os.getpid()}), flush=True)
    line = sys.stdin.readline()
    if not line:
        raise UserError("parked worker: stdin closed before an assignment arrived")
    return WorkerAssignment.from_json(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lazarus worker",
        description=f"Run one trainer rank. The assignment (JSON) comes from --assignment FILE, "
                    f"from ${ASSIGNMENT_ENV}, or with --park from one line on stdin.")
    parser.add_argument("--assignment", metavar="FILE", help="JSON file with the assignment")
    parser.add_argument("--park", action="store_true",
                        help="import everything, print a 'parked' JSON line, then wait for one "
                             "assignment line on stdin and run its command as that rank")
    parser.add_argument("--zygote", metavar="CONTROL_FD", type=int,
                        help="import everything once, then fork a child for each request on "
                             "the agent's socket CONTROL_FD (lazarus.trainer.zygote)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.zygote is not None:
        try:
            is_socket = stat.S_ISSOCK(os.fstat(args.zygote).st_mode)
        except OSError:
            is_socket = False
        if not is_socket:
            print(f"lazarus worker: error: --zygote {args.zygote}: not an open socket; the "
                  f"agent starts the zygote with one of its own (lazarus.agent.zygote)",
                  file=sys.stderr)
            return 2
        from lazarus.trainer.zygote import run_child, serve  # here: only --zygote needs it
        run_child(*serve(args.zygote))  # serve returns in a forked child only
        return 0
    if args.park:
        # Every command of a job, this trainer's too, starts here (lazarus.trainer.rankrun).
        from lazarus.trainer.rankrun import run_rank
        run_rank(_park())
    if args.assignment:
        try:
            text = open(args.assignment, encoding="utf-8").read()
        except OSError as e:
            raise UserError(f"cannot read assignment {args.assignment}: {e.strerror}") from None
        assignment = WorkerAssignment.from_json(text)
    elif ASSIGNMENT_ENV in os.environ:
        assignment = WorkerAssignment.from_json(os.environ[ASSIGNMENT_ENV])
    else:
        raise UserError(f"no assignment: pass --assignment FILE, --park, or set {ASSIGNMENT_ENV}")
    process = this_process()
    try:
        code = run(assignment, process=process)
        while isinstance(code, Survived):  # the next round, in this process
            # the recovery's cost to this process, from the assignment in hand
            cost = StartCost(code.next.store_port, code.next.round)
            inplace.enter_next(code.next)
            code = run(code.next, process=process, in_place=True, cost=cost)
    except BaseException as e:
        exitnote.record(2 if isinstance(e, UserError) else 1)  # as lazarus.cli exits
        raise
    exitnote.record(code)
    return code


if __name__ == "__main__":  # the built-in trainer's command (lazarus.core.jobcommand.BUILTIN)
    exitnote.finish(main())
