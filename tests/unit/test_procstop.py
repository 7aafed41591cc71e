"""lazarus.core.procstop on real children: one that exits on SIGTERM goes within the grace,
one that ignores it is SIGKILLed after it, and either way it is reaped."""

from __future__ import annotations

import signal
import subprocess

from lazarus.core import procstop


def _polite() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"])


def _deaf() -> subprocess.Popen:
    # `exec` so that the process SIGKILL reaches is the one ignoring SIGTERM (sleep inherits
    # the ignored disposition), and no orphan sleep is left; "ready" once the trap is set, or
    # SIGTERM could come first and end the shell the ordinary way.
    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; echo ready; exec sleep 600"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_a_child_that_exits_on_sigterm_is_not_killed():
    proc = _polite()
    procstop.stop(proc, 30)
    assert proc.returncode == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    proc = _deaf()
    procstop.stop(proc, 0.2)
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()


def test_stop_all_stops_each_the_way_it_takes():
    polite, deaf = _polite(), _deaf()
    procstop.stop_all([deaf, polite], 2)  # ample for sleep to die of SIGTERM on a busy host
    assert (polite.returncode, deaf.returncode) == (-signal.SIGTERM, -signal.SIGKILL)
    deaf.stdout.close()


def test_a_child_that_exited_already_is_left_as_it_was():
    proc = subprocess.Popen(["true"])
    proc.wait()
    procstop.stop(proc, 0.2)
    assert proc.returncode == 0
