"""How the benchmarks start their job: a whole local cluster (`lazarus up`), or the same trainer
under plain torchrun (torchrun_worker.py) as the baseline. Both write rank 0's metrics lines,
which the benchmarks follow with lazarus.sim.up.MetricsTail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lazarus.sim import up
from lazarus.sim.up import MetricsTail

# The recovery benchmark's job, as `lazarus up` options: tiny model, 2 ranks (one per node),
# gloo. start_torchrun turns it into the [train] table `lazarus up` would build.
TRAIN = {"model": "tiny", "tp": 1, "global_batch": 8, "seq_len": 64, "ckpt_every": 4,
         "warmup_steps": 10}
# The same with steps of about 0.6 s on 2 cores (0.1 s above): long enough that 3 x the
# median step time is above a 1 s hang floor, and that the agents' work per step is small.
LONG_STEPS = {**TRAIN, "seq_len": 512, "global_batch": 32}


def lazarus_up(tmp: Path, train: dict, *, chaos: str, spares: int,
               extra: tuple[str, ...] = ()) -> dict:
    """`lazarus up` on 2 nodes with `train`'s shape; its summary, once the run succeeded."""
    args = up._parse(["--workdir", str(tmp), "--quiet", "--nodes", "2", "--spares", str(spares),
                      "--model", train["model"], "--steps", str(train["steps"]),
                      "--seq-len", str(train["seq_len"]),
                      "--global-batch", str(train["global_batch"]),
                      "--ckpt-every", str(train["ckpt_every"]), "--chaos", chaos, *extra])
    summary = up.run(args)
    assert summary["final_state"] == "SUCCEEDED", summary
    return summary


def start_torchrun(tmp: Path, train: dict, *, env: dict[str, str] | None = None,
                   max_restarts: int = 3) -> tuple[subprocess.Popen, MetricsTail]:
    """`torchrun --standalone` with 2 ranks on `train`; its metrics are followed by the tail.
    Stop it with `stop`."""
    tmp.mkdir(parents=True)
    metrics = tmp / "metrics.jsonl"
    job = {"steps": train["steps"], "metrics": str(metrics), "model": {"name": train["model"]},
           "parallelism": {"dp": 2, "tp": train["tp"]},
           "optimizer": {"warmup_steps": train["warmup_steps"]},
           "data": {"global_batch": train["global_batch"], "seq_len": train["seq_len"]},
           "checkpoint": {"dir": str(tmp / "ckpt"), "every": train["ckpt_every"]}}
    (tmp / "train.json").write_text(json.dumps(job))
    script = Path(__file__).with_name("torchrun_worker.py")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
                             "--monitor-interval", "0.1", str(script), str(tmp / "train.json")],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "torchrun.log").open("w"),
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]),
                                 **(env or {})})
    return proc, MetricsTail(metrics)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(30)
