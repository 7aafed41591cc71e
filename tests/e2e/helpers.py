"""Shared pieces of the end-to-end tests: reference runs and metrics files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lazarus.core.stall import is_step
from lazarus.sim.localcluster import LocalCluster
from lazarus.sim.trainer_faults import worker_env


def losses(metrics: Path) -> dict[int, float]:
    """step -> loss; a step replayed after a recovery keeps its last value."""
    out = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if is_step(rec):
            out[rec["step"]] = rec["loss"]
    return out


def last_step(metrics: Path) -> int:
    """The step of the metrics file's last step line (0: none yet); a line the rank is still
    writing counts as not there yet."""
    last = 0
    for line in (metrics.read_text().splitlines() if metrics.exists() else []):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if is_step(row):
            last = row["step"]
    return last


def train_table(steps: int, **sections: dict) -> dict:
    """The [train] table of the e2e jobs (the shape `lazarus up` runs with these tests'
    options), for `steps` steps; `sections` add to its sections, e.g. guard={"window": 8}."""
    table = {"steps": steps, "model": {"name": "tiny"}, "parallelism": {"tp": 1},
             "optimizer": {"warmup_steps": 10}, "data": {"global_batch": 8, "seq_len": 64},
             "checkpoint": {"every": 4}}
    for name, extra in sections.items():
        table[name] = {**table.get(name, {}), **extra}
    return table


# One run per distinct reference for the whole session: the e2e tests mostly compare with the
# same few (36, 60 and 160 steps of train_table), and each run is ~8-11 s of the suite's time.
_REFERENCES: dict[str, dict[int, float]] = {}


def reference(tmp: Path, train: dict, *, nproc: int, dp: int, tp: int,
              faults: tuple[str, ...] = ()) -> dict[int, float]:
    """The uninterrupted run of the same [train] table with `lazarus train`, its ranks injecting
    `faults` (lazarus.sim.trainer_faults) as the cluster's did. Runs once per distinct
    reference in a session; a copy of the losses comes back."""
    # Where the cluster kept checkpoints and metrics is no business of the reference run.
    lines = ["[train]"] + [f"{k} = {json.dumps(v)}" for k, v in train.items()
                           if not isinstance(v, dict) and k != "metrics"]
    for section, table in train.items():
        kept = {k: v for k, v in table.items() if section != "checkpoint" or k not in ("dir", "every")} \
            if isinstance(table, dict) else {}
        if kept:
            lines += [f"[train.{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in kept.items()]
    key = json.dumps([lines, nproc, dp, tp, sorted(faults)])
    if key not in _REFERENCES:
        _REFERENCES[key] = _run_reference(tmp, lines, nproc=nproc, dp=dp, tp=tp, faults=faults)
    return dict(_REFERENCES[key])


def _run_reference(tmp: Path, lines: list[str], *, nproc: int, dp: int, tp: int,
                   faults: tuple[str, ...]) -> dict[int, float]:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "ref.toml"
    cfg.write_text("\n".join(lines) + "\n")
    metrics = tmp / "ref.jsonl"
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "train", "--nproc", str(nproc),
                           "--dp", str(dp), "--tp", str(tp), "--config", str(cfg),
                           "--metrics", str(metrics)], capture_output=True, text=True,
                          env={**os.environ, **(worker_env(faults) if faults else {})},
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


def lazarus(cluster: LocalCluster, *argv: str) -> str:
    """`lazarus COMMAND ...` against the cluster's daemons, as an operator types it; its
    output, once it succeeded."""
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", *argv, "--address",
                           cluster.api_addresses[0], "--token-file", str(cluster.token_file)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def paused_and_stopped(view) -> bool:
    """The run is PAUSED and its members' ranks have stopped: PAUSED comes with the pause's
    commit, the ranks stop after it (and may commit one more checkpoint meanwhile)."""
    if not (view.status and view.status.state == "PAUSED"):
        return False
    return all(view.node_status.get(n) is not None and view.node_status[n].workers != "running"
               for n in view.status.members)


# A user's venv with real frameworks that Lazarus's own venv does not have (docs/adopting.md,
# "Your environment"), built once at the repository's root: about a minute, torch's CPU wheel
# coming from this machine's disk.
FRAMEWORK_VENV = Path(__file__).resolve().parents[2] / ".venv-frameworks"
FRAMEWORK_PACKAGES = ["torch==2.13.0", "numpy", "lightning>=2.6,<2.7", "accelerate>=1.10"]


def framework_venv() -> Path:
    python = FRAMEWORK_VENV / "bin" / "python"
    probe = [str(python), "-c", "import lightning, accelerate, torch"]
    if not python.exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(FRAMEWORK_VENV)],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *FRAMEWORK_PACKAGES],
                       check=True, timeout=1200)
    return FRAMEWORK_VENV
