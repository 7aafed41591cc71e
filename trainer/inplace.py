"""A rank that outlives its round (docs/inplace.md).

When a collective fails because a peer is gone, the built-in trainer's rank does not exit: it
tells its agent it survived, aborts every process group it holds (which on NCCL also releases
a collective still waiting on the dead or frozen peer), and waits on the worker channel for
its assignment in the next round. The agent hands it one instead of starting a parked
worker, and the rank joins the new round in the same process: its interpreter, imports,
CUDA context, compiled kernels and warmed DTensor/FSDP2 caches stay; its model and optimizer
are rebuilt around the state the round restores, like every other rank's, so every rank
resumes from the same step by construction.

Whatever does not go to plan ends the process as before (exit PEER_LOST): an abort that does
not return within ABORT_S, no assignment within `resume_wait_s()` (the round went on
without this process, or its node was cut off), a malformed one. The next round then starts this rank
anew from a parked worker: the process restart every recovery used to be.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from lazarus.core.contract import AGENT_GRACE_ENV, IN_PLACE_ENV, WorkerAssignment
from lazarus.core.errors import UserError
from lazarus.trainer.peerloss import is_peer_failure
from lazarus.trainer.rankprocess import this_process
from lazarus.trainer.rankrun import drop_agent_store, enter
from lazarus.trainer.session import _assignment, connect, script_sessions

T = TypeVar("T")

# Aborting gloo or NCCL groups takes milliseconds; a bound this long is a wedged driver.
ABORT_S = 10.0
# The next round comes within the lease TTL (a lost node) plus the daemon's decision; past
# twice the agent's grace (a lease TTL and a margin: lazarus.agent.service) the round has gone
# on without this process, or its node was cut off and declared lost: it must not hold its
# device longer. RESUME_WAIT_S when the agent sets no grace.
RESUME_WAIT_S = 120.0


def resume_wait_s() -> float:
    try:
        grace = float(os.environ.get(AGENT_GRACE_ENV) or 0)
    except ValueError:
        grace = 0.0
    return 2 * grace if grace > 0 else RESUME_WAIT_S


def enabled(a: WorkerAssignment) -> bool:
    """Whether this rank may outlive its round: under an agent, unless the job said off."""
    return bool(a.report_socket) and os.environ.get(IN_PLACE_ENV, "on").lower() != "off"


# One abort at a time: the agent's word (`told_by_agent`) and the rank's own failure may
# both come.
_abort_lock = threading.Lock()


def release_groups(timeout_s: float = ABORT_S) -> bool:
    """Abort every process group of this process, the default one included: True when that
    returned within `timeout_s`. Afterwards c10d's registry is empty and its group counter
    is back at zero, so the next round's groups get the same names as this round's."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    done = threading.Event()

    def abort() -> None:
        with _abort_lock:
            try:
                if dist.is_initialized():
                    c10d._abort_process_group()
            except Exception:  # noqa: BLE001 -- a group the failure left half-made: destroy it
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 -- gone either way
                    pass
        done.set()

    threading.Thread(target=abort, daemon=True, name="lazarus-abort").start()
    return done.wait(timeout_s) and not dist.is_initialized()


def hang_up_tcp() -> int:
    """Shut down every connected TCP socket of this process: the connections of the round it
    left (gloo's pairs, its store's), which abort does not close on gloo. A peer blocked in a
    collective on one of them then fails at once and survives in turn, instead of waiting for
    this process to exit (docs/scale.md: 1 of 7 survivors kept otherwise at 8 ranks). The
    next round's connections are made after. The number shut down."""
    import socket

    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                s.getpeername()  # a listening or unconnected socket raises: left alone
                s.shutdown(socket.SHUT_RDWR)  # the socket's, not this descriptor's
                count += 1
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only
    return count


def told_by_agent(round_: int) -> None:
    """The agent says a peer of round `round_` on another node is gone (its `abort_groups`
    message: lazarus.agent.decide.ReleaseVictims); called on the session's reader thread.

    On NCCL the groups are aborted at once: over NVLink or shared memory a collective that
    waits on a dead or frozen peer never fails by itself, and the abort makes it (and every
    later one) raise, which the rank takes as a lost peer (`lost_peer`). On gloo nothing is
    aborted: gloo's abort does not cancel a collective in progress, and the culprit's end
    resets the sockets its peers wait on, which fails theirs (docs/inplace.md)."""
    from lazarus.trainer.collprogress import uses_nccl  # imports torch: a rank's, not here

    process = this_process()
    if process.told == round_ or process.round not in (None, round_):
        return  # said before, or of a round this process has left
    process.told = round_
    nccl = uses_nccl()
    print(f"round {round_}: the agent says a peer on another node is gone"
          f"{'; aborting the process groups' if nccl else ''}", file=sys.stderr, flush=True)
    if nccl:
        threading.Thread(target=release_groups, daemon=True, name="lazarus-told").start()


def lost_peer(a: WorkerAssignment, e: BaseException) -> bool:
    """Whether `e` ends this rank's round because a peer is gone: its text says so, or the
    agent said so first (after which any failure is the abort's)."""
    return is_peer_failure(e) or this_process().told == a.round


def peer_gone(a: WorkerAssignment, e: BaseException) -> str:
    """Say in the rank's log that `e` is a lost peer's; the reason, in one line."""
    why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    print(f"rank {a.rank} round {a.round}: a peer is gone ({why})", file=sys.stderr, flush=True)
    return why


def enter_next(nxt: WorkerAssignment) -> None:
    """Become the rank of the next round `nxt` in this process: its log and environment
    (lazarus.trainer.rankrun.enter), after letting the last round's model, optimizer and
    buffers go. They are cycles (modules, hooks, the optimizer's references to the
    parameters) that only the collector frees, and on a GPU two copies may not fit."""
    import torch

    enter(nxt)
    process = this_process()
    process.round = nxt.round
    if not process.collected:  # survive() did it while it waited
        gc.collect()
    process.collected = False
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def survive(a: WorkerAssignment, session, step: int, reason: str, *,
            wait_s: float | None = None, own_sockets: bool = False) -> WorkerAssignment | None:
    """Stay for the next round: the assignment to run next, or None when this process
    should exit as a lost peer's survivor (see the module's doc). `wait_s`: how long to wait
    for it (default: `resume_wait_s()`). `own_sockets`: every TCP connection of this process
    is the round's (the built-in trainer's), so on gloo they are shut down (`hang_up_tcp`); a
    script's may be its own (a metrics service), and are left."""
    wait_s = resume_wait_s() if wait_s is None else wait_s
    this_process().noticed_at = time.time()
    # Said first: the agent must know not to kill this process when the round ends, which
    # can happen as soon as the daemon has seen the fault.
    session.survived(step, reason)
    from lazarus.trainer.collprogress import uses_nccl  # imports torch: a rank's, not here

    nccl = uses_nccl()  # asked before the groups go
    t0 = time.perf_counter()
    drop_agent_store()  # the round's: the next round connects anew
    if not release_groups():
        print(f"rank {a.rank} round {a.round}: aborting the process groups did not return "
              f"within {ABORT_S:.0f} s; exiting", file=sys.stderr, flush=True)
        return None
    if own_sockets and not nccl:
        hang_up_tcp()  # gloo's abort leaves the pairs open: the peers blocked on them notice
    print(f"rank {a.rank} round {a.round}: survived a lost peer; groups aborted in "
          f"{time.perf_counter() - t0:.3f} s, waiting for the next round", file=sys.stderr,
          flush=True)
    if "torch.distributed.device_mesh" in sys.modules:
        # While the next round is decided: its meshes adopt this round's (another rank of the
        # same shape would otherwise find this rank's coordinate in DTensor's caches).
        from lazarus.trainer import meshes
        meshes.collect("round")
    # The last round's model, optimizer and buffers are cycles only the collector frees
    # (0.14 s here): freed now, while the next round is decided, not after it came.
    gc.collect()
    process = this_process()
    process.collected, process.left_at = True, time.time()
    got = session.await_resume(wait_s)
    process.resumed_at = time.time()
    if got is None:
        print(f"rank {a.rank} round {a.round}: no next round for this process within "
              f"{wait_s:.0f} s; exiting", file=sys.stderr, flush=True)
        return None
    try:
        nxt = WorkerAssignment.from_dict(got)
    except UserError as e:
        print(f"rank {a.rank} round {a.round}: unusable next assignment: {e}", file=sys.stderr,
              flush=True)
        return None
    if nxt.local_rank != a.local_rank or nxt.round <= a.round:
        # The agent only hands a survivor its own device's next rank; anything else is a bug
        # there, and a fresh process is the safe answer.
        print(f"rank {a.rank} round {a.round}: next assignment for local rank "
              f"{nxt.local_rank} round {nxt.round} does not fit; exiting", file=sys.stderr,
              flush=True)
        return None
    return nxt


def run(main: Callable[[], T]) -> T:
    """Run a script's `main` -- its whole training: process group, model, restore, step loop --
    and when it fails because a peer is gone, stay for the next round in this process and run
    `main` again there (docs/adopting.md, "In place"). `main` must build everything from the
    environment each time, as under torchrun, and restore the round's state (`Session.restore`
    or `restore_point`). Outside an agent, with in-place recovery off, or when no next round
    comes, the failure is raised as it would be without this call."""
    a = _assignment()
    while True:
        before = script_sessions()
        try:
            return main()
        except Exception as e:
            if a is None or not enabled(a) or not lost_peer(a, e):
                raise
            why = peer_gone(a, e)
            traceback.clear_frames(e.__traceback__)  # main's model: freed while it waits
            # The sessions this round's `main` opened are its own: closed (a snapshot being
            # written finishes first), they leave no connection or thread behind.
            for left in script_sessions() - before:
                left.close()
            # A connection of its own: the script's session is the script's.
            session = connect(rank=a.rank, round=a.round, socket_path=a.report_socket)
            try:
                nxt = survive(a, session, 0, why)
            finally:
                session.close()
            if nxt is None:
                raise
        if nxt.rank != a.rank and "torch.distributed.tensor" in sys.modules:
            # The script builds its own meshes: DTensor's caches would hand it the last
            # round's, with this rank's old coordinate (lazarus.trainer.meshes).
            from lazarus.trainer import meshes
            meshes.drop_caches()
        enter_next(nxt)
        a = nxt
