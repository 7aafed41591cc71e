"""What of tests/gpu/run.sh can be checked without a GPU: its syntax, its refusal when a wheel
it must carry is missing, and that what it carries covers what the GPU tests import beyond
the GPU machine's image. (The GPU tests themselves skip here: tests/gpu/conftest.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"

# Our dependencies that the GPU machine's image already has (torch 2.11 with CUDA 13, as its
# notes list them); everything else the GPU tests import must travel as a wheel.
IN_IMAGE = {"torch", "numpy", "grpcio", "protobuf", "psutil", "nvidia-ml-py", "safetensors",
            "rich", "triton", "pytest", "hypothesis", "tokenizers"}
# Distribution name -> the module it installs, where they differ.
MODULES = {"nvidia-ml-py": "pynvml", "grpcio": "grpc", "protobuf": "google.protobuf",
           "opentelemetry-sdk": "opentelemetry.sdk",
           "opentelemetry-exporter-prometheus": "opentelemetry.exporter.prometheus",
           "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp"}
# What the GPU tests and figures import of ours.
GPU_IMPORTS = ["lazarus.cli", "lazarus.trainer.launch", "lazarus.trainer.worker",
               "lazarus.trainer.train", "lazarus.trainer.flightrec", "lazarus.trainer.snapshot",
               "lazarus.agent.stacks", "lazarus.agent.gpu", "lazarus.trainer.kernels",
               "lazarus.core.flops", "lazarus.trainer.models", "lazarus.agent.preflight_cli"]


def _carried() -> set[str]:
    lines = (GPU / "wheels.txt").read_text().splitlines()
    return {line.split("==")[0].strip() for line in lines if line.strip() and not line.startswith("#")}


def _name(requirement: str) -> str:
    for sep in "<>=!~[ ;":
        requirement = requirement.split(sep)[0]
    return requirement.strip()


def test_the_scripts_parse():
    for script in ("run.sh", "fetch-wheels.sh"):
        proc = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_every_wheel_is_pinned():
    lines = [line for line in (GPU / "wheels.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and all("==" in line for line in lines), lines


def _absent() -> list[str]:
    """Our dependencies the GPU machine has neither in its image nor as a carried wheel."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [n for n in map(_name, deps) if n not in IN_IMAGE | _carried()]


def _without_absent(body: str) -> subprocess.CompletedProcess:
    """Python `body` run with every module of `_absent()` made unimportable."""
    blocked = [MODULES.get(d, d.replace("-", "_")) for d in _absent()]
    code = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked) + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_the_gpu_tests_import_nothing_the_machine_lacks():
    absent = _absent()
    assert absent, "every dependency is on the GPU machine: drop this test's premise"
    proc = _without_absent("".join(f"import {m}\n" for m in GPU_IMPORTS))
    assert proc.returncode == 0, (f"a GPU test imports one of {absent}, which the GPU machine "
                                  f"lacks: add it to tests/gpu/wheels.txt\n{proc.stderr[-2000:]}")


def test_preflight_runs_with_only_what_the_gpu_machine_has(tmp_path):
    """tests/gpu/test_preflight_nvml.py runs the whole command there: what it imports while it
    runs (not only at the top of its modules) must be on that machine too."""
    (tmp_path / "work").mkdir()
    (tmp_path / "ckpt").mkdir()
    argv = ["preflight", "--workdir", str(tmp_path / "work"), "--checkpoint-dir",
            str(tmp_path / "ckpt"), "--skip", "clock", "--json"]
    proc = _without_absent(f"from lazarus import cli\nsys.exit(cli.main({argv!r}))\n")
    assert proc.returncode == 0 and '"state": "passed"' in proc.stdout, proc.stderr[-2000:]


def test_a_missing_wheel_is_named_before_anything_is_installed(tmp_path):
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    shutil.copy(GPU / "run.sh", gpu / "run.sh")
    shutil.copy(GPU / "wheels.txt", gpu / "wheels.txt")
    (gpu / "wheels").mkdir()
    proc = subprocess.run(["bash", str(gpu / "run.sh")], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2
    assert "wheels missing from tests/gpu/wheels: zstandard==" in proc.stderr
    assert "fetch-wheels.sh" in proc.stderr
