"""What Lazarus sees of a rank that runs a program of its own (a shell wrapper, a binary): a
watcher process beside it (docs/adopting.md, "Your environment").

Such a rank replaces its parked worker by exec, so nothing of Lazarus runs in it. The worker
forks this watcher first; the watcher tells the agent `joined` once a process of the rank
(the program or anything it started: the python a wrapper runs) holds a connection to the
round's store -- every rank's `init_process_group()` connects there (MASTER_ADDR:MASTER_PORT,
a store the agent hosts for the round alone), and only there. That is what the agent counts a
level-0 rank as running by, and the daemon a recovery as done by; without it the round would
be taken for one that never started and restarted after its rendezvous timeout.

The watcher is the rank's child, so the agent admits it on the channel, and it lives exactly
as long as the rank (a parent-death signal): a program that waits for all its children never
sees it exit first. What a rank's exit code means (a lost peer or its own crash) is read from
its output by the agent (lazarus.agent.workers), which has the code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from lazarus.core.contract import WorkerAssignment

# How often the watcher looks: a rendezvous timeout is minutes, a look costs a /proc read.
PERIOD_S = 0.5
_PR_SET_PDEATHSIG = 1


def start(a: WorkerAssignment) -> None:
    """Fork the watcher of this rank (which execs its program next); returns in the rank."""
    rank_pid = os.getpid()
    port = int(os.environ["MASTER_PORT"])
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() != 0:
        return
    code = 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == rank_pid:  # not already gone before the signal was asked for
            watch(rank_pid, port)
    except BaseException as e:  # noqa: BLE001 -- the rank goes on; only what it shows is less
        print(f"lazarus: the watcher of rank {a.rank} stopped: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        code = 1
    finally:
        os._exit(code)


def watch(rank_pid: int, port: int, period_s: float = PERIOD_S) -> None:
    """Tell the agent `joined` once the rank's processes connect to the store at `port`;
    then wait for the rank's end."""
    import psutil

    # here: only the forked watcher talks to the agent
    from lazarus.trainer.session import connect

    rank = psutil.Process(rank_pid)
    while os.getppid() == rank_pid:
        if connected(rank, port):
            session = connect(level=0)
            session.joined()
            break
        time.sleep(period_s)
    while os.getppid() == rank_pid:
        time.sleep(5 * period_s)  # the parent-death signal ends this; this is the fallback


def connected(proc, port: int) -> bool:
    """Whether `proc` or a process it started holds an established TCP connection to `port`."""
    import psutil

    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return False
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
               for c in conns):
            return True
    return False
