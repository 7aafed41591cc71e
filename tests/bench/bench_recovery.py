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

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lazarus import up
from lazarus.up import MetricsTail

pytestmark = pytest.mark.bench

TRAIN = {"model": "tiny", "tp": 1, "global_batch": 8, "seq_len": 64, "ckpt_every": 4,
         "warmup_steps": 10}
KILL_AT = 14
STEPS = 40


def _torchrun_recovery(tmp: Path) -> float:
    tmp.mkdir(parents=True)
    ckpt = tmp / "ckpt"
    metrics = tmp / "metrics.jsonl"
    train = {**TRAIN, "dp": 2, "steps": STEPS, "ckpt_dir": str(ckpt), "metrics": str(metrics)}
    (tmp / "train.json").write_text(json.dumps(train))
    script = Path(__file__).with_name("torchrun_worker.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "--max-restarts", "3",
                             "--monitor-interval", "0.1", str(script), str(tmp / "train.json")],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "torchrun.log").open("w"),
                            env=env)
    tail = MetricsTail(metrics)
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
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def _lazarus(tmp: Path, chaos: str, spares: int) -> dict:
    args = up._parse(["--workdir", str(tmp), "--quiet", "--nodes", "2", "--spares", str(spares),
                      "--steps", str(STEPS), "--seq-len", "64", "--global-batch", "8",
                      "--ckpt-every", "4", "--chaos", chaos])
    summary = up.run(args)
    assert summary["final_state"] == "SUCCEEDED", summary
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
