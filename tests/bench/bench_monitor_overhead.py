"""Monitor overhead (on demand): `pytest tests/bench/bench_monitor_overhead.py -m bench -s`.

Step time of one job (bench_hang.py's: tiny model, 2 ranks, gloo, steps of about 0.6 s) under
`lazarus up` with every monitor on -- the agents' GPU (simulated backend), host, hang and
throughput monitors, and the workers' progress reports -- and with all of them off
(`--monitors off`). Runs alternate (on, off, on, off, ...; LAZARUS_BENCH_MONITOR_REPS runs in
all, default 6) so that a change in the load of this shared machine falls on both settings
alike. Prints each run's median step time, the median of each setting, and the overhead.
Target (issue 5): under 1%.

A step's time is rank 0's `step_time_s`: the progress reports are sent inside it; the agents'
work shows in it only as CPU taken from the ranks (2 ranks, 2 agents and the daemons share
2 cores here). Step times of separate runs on a shared machine differ by more than 1%, so the
agents' own CPU use while training, on and off, is printed too: other load blurs it far less.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

import psutil
import pytest

from lazarus.core.stall import is_step
from lazarus.sim.up import MetricsTail
from tests.bench.runs import LONG_STEPS, lazarus_up

pytestmark = pytest.mark.bench

# Checkpoints only at the end: a periodic async save slows the steps after it, noise that
# has nothing to do with the monitors.
JOB = {**LONG_STEPS, "steps": 40, "ckpt_every": 0}
# Left out: start-up and warm-up, and the seconds in which each agent warms up a new parked
# worker in place of the one the round took (importing torch, on the same 2 cores).
SKIP = 15
REPS = int(os.environ.get("LAZARUS_BENCH_MONITOR_REPS", "6"))


class _AgentCpu:
    """CPU time of one run's agents, sampled with rank 0's latest step, so that it is taken
    over the measured steps only (start-up, rendezvous and shutdown cost the same either way)."""

    def __init__(self, workdir: Path):
        self._marker = str(workdir / "nodes")   # the agents' --workdir
        self._tail = MetricsTail(workdir / "metrics.jsonl")
        self._agents: list[psutil.Process] = []
        self.samples: list[tuple[float, int, float]] = []  # (time, latest step, agents' CPU s)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "_AgentCpu":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._done.wait(0.2):
            if len(self._agents) < 2:
                self._agents = [p for p in psutil.process_iter(["cmdline"])
                                if {"agent", self._marker} <= set(p.info["cmdline"] or ())]
                continue
            self._tail.poll()
            try:
                cpu = sum(p.cpu_times().user + p.cpu_times().system for p in self._agents)
            except psutil.Error:
                continue  # an agent is gone: the run is over
            if self._tail.latest:
                self.samples.append((time.monotonic(), self._tail.latest["step"], cpu))

    def core_share(self, first: int, last: int) -> float:
        """The agents' CPU seconds per second while steps first..last ran."""
        t0, _, c0 = next(s for s in self.samples if s[1] >= first)
        t1, _, c1 = [s for s in self.samples if s[1] <= last][-1]
        return (c1 - c0) / (t1 - t0)


def _run(tmp: Path, monitors: str) -> tuple[float, float]:
    """(median step time s, agents' share of a core) of one run."""
    with _AgentCpu(tmp) as agents:
        summary = lazarus_up(tmp, JOB, chaos="none", spares=0, extra=("--monitors", monitors))
    recs = [r for r in map(json.loads, Path(summary["metrics"]).read_text().splitlines())
            if is_step(r)]
    assert [r["step"] for r in recs] == list(range(1, JOB["steps"] + 1)), \
        f"the run was interrupted (steps re-run); see {tmp}"
    # the last step is left out too: it ends with the run's checkpoint
    return (statistics.median(r["step_time_s"] for r in recs[SKIP:-1]),
            agents.core_share(SKIP, JOB["steps"] - 1))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@pytest.mark.timeout(150 * REPS + 60)
def test_monitor_overhead(tmp_path):
    runs: list[tuple[str, float, float, str]] = []  # (monitors, step s, agents' core, load)
    for i in range(REPS):
        mode = "on" if i % 2 == 0 else "off"
        load = _load()
        runs.append((mode, *_run(tmp_path / f"{i}-{mode}", mode), load))
    on = [s for mode, s, _, _ in runs if mode == "on"]
    off = [s for mode, s, _, _ in runs if mode == "off"]
    print(f"\n== monitor overhead: median step time, monitors on vs off (tiny model, seq "
          f"{JOB['seq_len']}, batch {JOB['global_batch']}, 2 ranks, gloo; steps {SKIP + 1}.."
          f"{JOB['steps'] - 1} of {JOB['steps']} per run) ==")
    print(f"{'run':>3} {'monitors':>8} {'median step':>12} {'agents CPU':>11}   "
          f"load avg before (1, 5, 15 min)")
    for i, (mode, s, cpu, load) in enumerate(runs):
        print(f"{i:>3} {mode:>8} {s * 1000:>9.1f} ms {cpu * 100:>7.1f} %   {load}")
    on_s, off_s = statistics.median(on), statistics.median(off)
    print(f"median of the runs: on {on_s * 1000:.1f} ms, off {off_s * 1000:.1f} ms; "
          f"overhead {(on_s / off_s - 1) * 100:+.2f}% (target < 1%)")
    pairs = [(a / b - 1) * 100 for a, b in zip(on, off)]
    print("overhead per (on, off) pair: " + ", ".join(f"{p:+.2f}%" for p in pairs))
    print(f"spread between runs of one setting: on {(max(on) / min(on) - 1) * 100:.1f}%, "
          f"off {(max(off) / min(off) - 1) * 100:.1f}%")
    cpu_on = statistics.median(c for mode, _, c, _ in runs if mode == "on")
    cpu_off = statistics.median(c for mode, _, c, _ in runs if mode == "off")
    print(f"both agents' CPU while training, in % of one core (median of the runs): on "
          f"{cpu_on * 100:.1f}%, off {cpu_off * 100:.1f}%, difference "
          f"{(cpu_on - cpu_off) * 100:+.1f}% of a core")
    print(f"load average at end: {_load()}")
