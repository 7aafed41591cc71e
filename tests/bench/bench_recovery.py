"""Recovery benchmark (on demand): `pytest tests/bench/bench_recovery.py -m bench -s`.

In one run, on the same tiny job (2 ranks, gloo, checkpoint every 4 steps):
  - Lazarus: SIGKILL one rank -> next completed step (agents + daemon + parked workers);
  - torchrun --max-restarts: the same kill -> next completed step (the same trainer, resuming
    from the same kind of checkpoint);
  - Lazarus: SIGKILL a whole node (agent and its ranks) with a warm spare -> next step, and
    that time minus the lease TTL (the part a faster failure detector could not remove).
Prints each figure and the ratio Lazarus / torchrun. The first step after a recovery
re-does the steps since the checkpoint; both systems pay that equally.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.bench.runs import TRAIN, lazarus_up, start_torchrun, stop

pytestmark = pytest.mark.bench

KILL_AT = 14
STEPS = 40


def _torchrun_recovery(tmp: Path) -> float:
    proc, tail = start_torchrun(tmp, {**TRAIN, "steps": STEPS})
    killed_at = None
    try:
        while proc.poll() is None:
            time.sleep(0.02)
            tail.poll()
            if killed_at is None:
                if tail.latest and tail.latest["step"] >= KILL_AT:
                    victim = psutil.Process(proc.pid).children(recursive=True)[-1]
                    killed_at = time.time()
                    victim.send_signal(signal.SIGKILL)
            elif (after := tail.first_step_after(killed_at + 0.05)) is not None:
                return after[0] - killed_at
        raise AssertionError(f"torchrun did not recover (exit {proc.returncode}); see {tmp}")
    finally:
        stop(proc)


def _lazarus(tmp: Path, chaos: str, spares: int) -> dict:
    summary = lazarus_up(tmp, {**TRAIN, "steps": STEPS}, chaos=chaos, spares=spares)
    return summary["recoveries"][0]


def test_recovery_vs_torchrun(tmp_path):
    crash = _lazarus(tmp_path / "lazarus-crash", f"kill-worker@{KILL_AT}:n1", spares=0)
    torchrun_s = _torchrun_recovery(tmp_path / "torchrun")
    node = _lazarus(tmp_path / "lazarus-node", f"kill-node@{KILL_AT}:n1", spares=1)
    ttl = 3  # lazarus up's default lease TTL
    print("\n== recovery: fault -> next completed step (tiny model, 2 ranks, gloo) ==")
    print(f"lazarus worker crash      {crash['recovered_after_s']:6.2f} s "
          f"(detected after {crash['detected_after_s']:.2f} s)")
    print(f"torchrun --max-restarts   {torchrun_s:6.2f} s")
    print(f"ratio lazarus/torchrun    {crash['recovered_after_s'] / torchrun_s:6.2f}")
    print(f"lazarus node loss, spare  {node['recovered_after_s']:6.2f} s "
          f"(detected after {node['detected_after_s']:.2f} s; "
          f"{node['recovered_after_s'] - ttl:.2f} s beyond the {ttl} s lease TTL)")
