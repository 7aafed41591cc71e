"""What Lazarus sees of a rank whose script reports nothing itself (level 0, docs/adopting.md).

A thread in the rank's process (the parked worker runs the script in-process,
lazarus.trainer.rankrun) tells the agent:
  - `joined`: the script made its default process group, i.e. the round's rendezvous is done
    here -- the agent counts the rank as running from then on (a script that never joins is
    named when the round's rendezvous timeout runs out);
  - `progress`: how many collectives the rank has done over all its process groups (on
    CUDA, those its device has passed: lazarus.trainer.collprogress), whenever that changes. A rank that stops issuing them while its peers wait in one is
    behind them, and the agent's hang detector names it (lazarus.agent.hang) with the
    allowance of a step it never saw complete: the first-step timeout.
The least of a node's ranks' collectives, and when the newest was seen, ride on its node
status (lazarus.agent.nodestatus), and `lazarus status` shows them for a script with no step.
It stops reporting progress once the script reports its own (`Session.progress`, level 1):
those say more than this can. A rank alone in its world reports only its joining: it has no
peer to hang on, and its script may issue no collective at all.
"""

from __future__ import annotations

import threading
import time

# How often the thread looks: a hang allowance is tens of seconds, a read costs microseconds.
PERIOD_S = 0.5


def _issued() -> int | None:
    """Collectives this process has issued over all its process groups; None before it has
    a default group."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    # here, as torch above: the rank side imports torch only when it runs
    from lazarus.trainer.collprogress import issued

    if not dist.is_initialized():
        return None
    for _ in range(3):  # the script may be making a group meanwhile
        try:
            return issued(list(c10d._world.pg_map))
        except RuntimeError:
            continue
    return None


def _alone() -> bool:
    """Whether this rank's world is itself alone (its default group has one member)."""
    import torch.distributed as dist

    try:
        return dist.get_world_size() == 1
    except (RuntimeError, ValueError):  # the group went meanwhile
        return False


def _loop(period_s: float) -> None:
    # here: collprogress loads torch, which the rank side imports only when it runs
    from lazarus.trainer import session as sessions
    from lazarus.trainer.collprogress import Completed, script_device

    session = sessions.connect(level=0)
    if not session.connected:
        return
    joined = False
    last = None
    completed = None
    while True:
        time.sleep(period_s)
        if sessions.progress_by_script():
            return  # the script's own progress reports are better than ours
        seq = _issued()
        if seq is None:
            continue
        if completed is None or (completed.device is None and script_device() is not None):
            completed = Completed(script_device())  # once the script has its device
        seq = completed.count(seq)
        if not joined:
            session.joined()
            joined = True
            if _alone():
                # A world of one rank waits on no peer in a collective, and may issue none a
                # step (TorchTitan on one GPU issues none): its count would only ever look
                # stalled -- a hang after the first-step timeout, a chaos clock that never
                # starts. Unwatched, the agent sees it as a rank that reports no progress.
                return
        if seq != last:
            last = seq
            session.progress(step=0, phase="collective", seq=seq)


def watch(period_s: float = PERIOD_S) -> threading.Thread:
    thread = threading.Thread(target=_loop, args=(period_s,), daemon=True,
                              name="lazarus-collwatch")
    thread.start()
    return thread
