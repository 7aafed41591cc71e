"""Stopping child processes: SIGTERM, a grace period to exit on it, then SIGKILL.

For subprocess.Popen and what acts like it (poll, terminate, kill, and a wait whose timeout
raises subprocess.TimeoutExpired: lazarus.trainer.forkranks' ranks). A pid or a process group
that is not this process's child has no wait to give a grace with; nothing here stops one.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable


def stop_all(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM each of `procs` still running, let them exit within `grace_s`, SIGKILL those
    that did not; returns once every one is reaped. They share the grace: stopping many
    takes `grace_s` at most, not that many times it."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """`proc` alone, as `stop_all` stops several."""
    stop_all([proc], grace_s)
