"""Hang benchmark (on demand): `pytest tests/bench/bench_hang.py -m bench -s`.

In one run, on the same job (tiny model, 2 ranks, gloo, checkpoint every 4 steps), rank 1
stops forever before its forward pass at step HANG_AT (hang@STEP of lazarus.sim.trainer_faults)
and rank 0 waits for it in FSDP's all-gather. Measured from the hang, that is from the moment
rank 0's metrics line of the step before showed up (the hung rank stops a collective later),
to detection, to the restart and to the next completed step:
  - Lazarus (`lazarus up --chaos hang@N`) with the agents' default floor (10 s), and with a
    1 s floor, where the allowance of k x the median step time decides;
  - torchrun --max-restarts with a 30 s process-group timeout: rank 0's collective times
    out, its process exits, torchrun restarts every worker;
  - torchrun with the default process-group timeout (gloo: 30 min), waited for at most
    LAZARUS_BENCH_TORCHRUN_DEFAULT_CAP_S seconds (default 120).
Every run resumes from the same checkpoint; the next completed step re-does the steps since.
Steps here are longer than the recovery benchmark's (runs.LONG_STEPS: about 0.6 s on 2 cores)
so that 3 x the median step time is above the 1 s floor.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from lazarus.core.records import EventRecord
from lazarus.core.contract import PG_TIMEOUT_ENV
from lazarus.sim.trainer_faults import worker_env
from lazarus.sim.up import MetricsTail
from tests.bench.runs import LONG_STEPS, lazarus_up, start_torchrun, stop

pytestmark = pytest.mark.bench

JOB = {**LONG_STEPS, "steps": 16}
HANG_AT = 12          # the checkpoint before it is step 8; step 11 is no checkpoint step
LOW_FLOOR_S = 1.0
TORCHRUN_TIMEOUT_S = 30
DEFAULT_TIMEOUT_S = int(dist.default_pg_timeout.total_seconds())
DEFAULT_CAP_S = float(os.environ.get("LAZARUS_BENCH_TORCHRUN_DEFAULT_CAP_S", "120"))


def _arrival(tail: MetricsTail, step: int) -> float:
    """When the first metrics line of `step` was seen."""
    return next(at for at, rec in tail.seen if rec["step"] == step)


def _median_step_s(tail: MetricsTail) -> float:
    """Median wall time between completed steps before the hang (the first two left out:
    start-up and warm-up)."""
    at = [_arrival(tail, s) for s in range(2, HANG_AT)]
    return statistics.median(b - a for a, b in zip(at, at[1:]))


def _lazarus(tmp: Path, *extra: str) -> dict:
    # up's own loop sees metrics every 50 ms or more (it also asks etcd each pass); follow
    # them closer here to time the hang.
    tail = MetricsTail(tmp / "metrics.jsonl")
    done = threading.Event()

    def follow():
        while not done.is_set():
            tail.poll()
            time.sleep(0.01)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    load = os.getloadavg()
    try:
        summary = lazarus_up(tmp, JOB, chaos=f"hang@{HANG_AT}", spares=0, extra=extra)
    finally:
        done.set()
        follower.join()
    (rec,) = summary["recoveries"]
    assert (rec["detected_as"], rec["culprit"]) == ("hang", "n1"), rec  # rank 1 is on n1
    hung_at = _arrival(tail, HANG_AT - 1)
    fired_at = summary["faults"][0]["time"]   # up's view of the same moment
    events = [EventRecord.from_json(line)
              for line in (tmp / "events.jsonl").read_text().splitlines()]
    detected = fired_at + rec["detected_after_s"]
    restart = next(e for e in events if e.kind == "round_started" and e.time >= detected)
    incident = next(e for e in events if e.kind == "fault_detected").fields
    allowance = re.search(r"allowance ([\d.]+) s", (tmp / "agent-n1.log").read_text())
    return {"median_s": _median_step_s(tail), "detected_s": detected - hung_at,
            "restarted_s": restart.time - hung_at,
            "next_step_s": fired_at + rec["recovered_after_s"] - hung_at,
            "allowance_s": float(allowance[1]) if allowance else None,
            "up_lag_s": fired_at - hung_at,
            "daemon_view_s": incident["detected_at"] - incident["fault_at"], "load": load}


def _workers(proc) -> set[int]:
    return {p.pid for p in psutil.Process(proc.pid).children()
            if p.status() != psutil.STATUS_ZOMBIE}


def _torchrun(tmp: Path, pg_timeout_s: int, cap_s: float) -> dict | None:
    """None when the run did not restart within `cap_s` of the hang."""
    load = os.getloadavg()
    proc, tail = start_torchrun(tmp, JOB, env={PG_TIMEOUT_ENV: str(pg_timeout_s),
                                               **worker_env([f"hang@{HANG_AT}:1"])})
    hung_at = exited = restarted = None
    try:
        while proc.poll() is None:
            time.sleep(0.02)
            tail.poll()
            now = time.time()
            if hung_at is None:
                if tail.latest and tail.latest["step"] >= HANG_AT - 1:
                    hung_at = _arrival(tail, HANG_AT - 1)
                    hung_group = _workers(proc)
                continue
            if now - hung_at > cap_s:
                return None
            live = _workers(proc)
            if exited is None and not hung_group <= live:
                exited = now   # a rank of the hung group gave up (its collective timed out)
            if restarted is None and live - hung_group:
                restarted = now
            if restarted is not None and (nxt := tail.first_step_after(restarted)) is not None:
                return {"median_s": _median_step_s(tail), "detected_s": exited - hung_at,
                        "restarted_s": restarted - hung_at, "next_step_s": nxt[0] - hung_at,
                        "load": load}
        raise AssertionError(f"torchrun ended (exit {proc.returncode}) before the hang was "
                             f"recovered; see {tmp}")
    finally:
        stop(proc)


def _row(name: str, r: dict) -> str:
    return (f"{name:<34} {r['median_s']:>7.2f} s {r['detected_s']:>8.2f} s "
            f"{r['restarted_s']:>8.2f} s {r['next_step_s']:>8.2f} s "
            f"{r['detected_s'] / r['median_s']:>8.1f}   {_load(r['load'])}")


def _load(load: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


@pytest.mark.timeout(900 + DEFAULT_CAP_S)
def test_hang_vs_torchrun(tmp_path):
    start_load = os.getloadavg()
    default = _lazarus(tmp_path / "lazarus-default")
    low = _lazarus(tmp_path / "lazarus-low", "--hang-floor", str(LOW_FLOOR_S))
    torchrun = _torchrun(tmp_path / "torchrun-30s", TORCHRUN_TIMEOUT_S, TORCHRUN_TIMEOUT_S + 90)
    assert torchrun is not None, "torchrun with a 30 s timeout did not restart within 120 s"
    capped = _torchrun(tmp_path / "torchrun-default", DEFAULT_TIMEOUT_S, DEFAULT_CAP_S)

    print(f"\n== hang at step {HANG_AT} -> detection, restart, next completed step "
          f"(tiny model, seq {JOB['seq_len']}, batch {JOB['global_batch']}, 2 ranks, gloo) ==")
    print(f"{'':<34} {'median':>9} {'detected':>10} {'restarted':>10} {'next step':>10} "
          f"{'det/med':>8}   load avg at start")
    print(_row("lazarus, floor 10 s (default)", default))
    print(_row(f"lazarus, floor {LOW_FLOOR_S:g} s, k 3", low))
    print(_row(f"torchrun, PG timeout {TORCHRUN_TIMEOUT_S} s", torchrun))
    name = "torchrun, default PG timeout"
    if capped is None:
        print(f"{name:<34} > {DEFAULT_CAP_S:g} s (not recovered within the cap; default "
              f"timeout is {DEFAULT_TIMEOUT_S} s)")
    else:
        print(_row(name, capped))
    for label, r in (("floor 10 s", default), (f"floor {LOW_FLOOR_S:g} s", low)):
        print(f"ratio lazarus ({label}) / torchrun-{TORCHRUN_TIMEOUT_S}s: detected "
              f"{r['detected_s'] / torchrun['detected_s']:.2f}, next step "
              f"{r['next_step_s'] / torchrun['next_step_s']:.2f}")
    for label, r in (("floor 10 s", default), (f"floor {LOW_FLOOR_S:g} s", low)):
        allowance = "?" if r["allowance_s"] is None else f"{r['allowance_s']:.2f} s"
        print(f"lazarus {label}: agent's allowance {allowance}; up's own clock saw the hang "
              f"{r['up_lag_s']:.2f} s late; the daemon's incident says detected "
              f"{r['daemon_view_s']:.2f} s after the fault")
    print("torchrun 'detected': a rank of the hung group exited (its collective timed out)")
    print(f"load average (1, 5, 15 min): at start {_load(start_load)}, "
          f"at end {_load(os.getloadavg())}")
