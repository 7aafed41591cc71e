"""`lazarus train`'s ranks forked from the launcher, which imports torch and the trainer once
for all of them (docs/constraints.md, "Worker starts": 5.6 CPU-s a cold rank here).

The launcher forks before it hosts the store (its server thread would not be in the children)
and before it runs any kernel or touches CUDA. Each child waits on a pipe for its assignment,
which names the store's port once the store is up, then runs as `lazarus worker` would with
the assignment in its environment. Where forking is not safe -- torch was imported before the
launcher started (a test calling it in-process), or the CUDA driver is loaded -- `fork_ranks`
returns None and the launcher starts cold workers as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import traceback

from lazarus.core.contract import ASSIGNMENT_ENV
from lazarus.core.errors import UserError
from lazarus.trainer import exitnote, worker
from lazarus.trainer.zygote import import_for_fork, reseed_after_fork


class ForkedRank:
    """A rank forked from this process, behind the part of Popen's interface the launcher
    uses."""

    def __init__(self, pid: int, assignment_fd: int):
        self.pid = pid
        self.returncode: int | None = None
        self._assignment_fd = assignment_fd

    def hand(self, assignment_json: str) -> None:
        """Give the rank its assignment; it starts."""
        try:
            os.write(self._assignment_fd, (assignment_json + "\n").encode())
        except OSError:
            pass  # it died waiting: its exit code says so
        finally:
            os.close(self._assignment_fd)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def prepare(env: dict[str, str], *, imported_before: bool) -> bool:
    """Set the ranks' environment in this process (the OpenMP runtime reads it when torch
    loads it), then import what a rank imports. False when forking would not be safe."""
    if imported_before:
        return False
    os.environ.update(env)
    return import_for_fork()


def die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a rank must not outlive a launcher that was killed.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def fork_ranks(nproc: int) -> list[ForkedRank]:
    """`nproc` children, each waiting for its assignment (ForkedRank.hand)."""
    ranks = []
    for _ in range(nproc):
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            for other in ranks:  # the other ranks' pipes are the launcher's, not ours
                os.close(other._assignment_fd)
            _child(r)  # never returns
        os.close(r)
        ranks.append(ForkedRank(pid, w))
    return ranks


def _child(assignment_fd: int) -> None:
    code = 1
    try:
        die_with_parent()
        with os.fdopen(assignment_fd, "r", encoding="utf-8") as f:
            line = f.readline()
        if not line:
            os._exit(1)  # the launcher went before handing it over
        os.environ[ASSIGNMENT_ENV] = line.strip()
        reseed_after_fork()
        try:
            code = worker.main([])
        except UserError as e:  # as the CLI says it
            print(f"lazarus worker: error: {e}", file=sys.stderr)
            code = 2
        except KeyboardInterrupt:
            code = 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    exitnote.finish(code)
