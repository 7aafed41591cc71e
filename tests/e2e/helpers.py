"""Shared pieces of the end-to-end tests: reference runs and metrics files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from lazarus.sim.localcluster import LocalCluster


def losses(metrics: Path) -> dict[int, float]:
    """step -> loss; a step replayed after a recovery keeps its last value."""
    out = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def reference(tmp: Path, train: dict, *, nproc: int, dp: int, tp: int) -> dict[int, float]:
    """The uninterrupted run of the same [train] table with `lazarus train`."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "ref.toml"
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in train.items()
                     if k not in ("ckpt_dir", "ckpt_every", "metrics"))
    cfg.write_text("[train]\n" + body + "\n")
    metrics = tmp / "ref.jsonl"
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "train", "--nproc", str(nproc),
                           "--dp", str(dp), "--tp", str(tp), "--config", str(cfg),
                           "--metrics", str(metrics)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return losses(metrics)


def wait_for(cluster: LocalCluster, predicate, *, timeout: float, what: str):
    """Poll the cluster state until predicate(state) is truthy; returns that value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            st = cluster.state()
        except ConnectionError:
            time.sleep(0.2)
            continue
        value = predicate(st)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; "
                         f"logs in {cluster.workdir}")
