"""`lazarus preflight` as an operator runs it on a GPU node: the GPU check reads the card through
NVML (auto picks it where a driver is), the checkpoint round trip and the collective run, and
a node with fewer GPUs than it must have fails with the count, exit 1."""

from __future__ import annotations

import json
import subprocess
import sys


def preflight(tmp_path, *args: str) -> tuple[int, dict]:
    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "preflight", "--workdir",
                           str(tmp_path / "work"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--skip", "clock", "--json", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_gpu_node_passes_preflight_through_nvml(tmp_path):
    import torch

    n = torch.cuda.device_count()
    code, result = preflight(tmp_path)
    checks = {c["name"]: c for c in result["checks"]}
    assert code == 0 and result["state"] == "passed", result
    assert checks["gpu"]["reason"] == f"{n} GPU{'' if n == 1 else 's'} healthy (nvml)", checks
    assert not checks["checkpoint"]["skipped"] and checks["checkpoint"]["ok"], checks
    print("PREFLIGHT", {name: (c["ok"], round(c["cost_s"], 3), c["reason"])
                        for name, c in checks.items()})


def test_a_node_short_of_gpus_fails_preflight_with_the_count(tmp_path):
    import torch

    n = torch.cuda.device_count()
    code, result = preflight(tmp_path, "--gpus", str(n + 1))
    gpu = next(c for c in result["checks"] if c["name"] == "gpu")
    assert code == 1 and result["state"] == "failed", result
    assert not gpu["ok"] and gpu["reason"] == f"{n} of {n + 1} GPUs visible (nvml)", gpu
