"""What of tests/gpu/run.sh can be checked without a GPU: its syntax, its refusal when a wheel
it must carry is missing, and that what it carries, with the GPU machine's image, holds every
dependency of ours and what those need in turn (`lazarus up` runs there: daemons, agents,
etcd). (The GPU tests themselves skip here: tests/gpu/conftest.py.)"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "tests" / "gpu"

# What the GPU machine's image already has of what we need (torch 2.11 with CUDA 13, as its
# notes list them); everything else must travel as a wheel.
IN_IMAGE = {"torch", "numpy", "grpcio", "protobuf", "psutil", "nvidia-ml-py", "safetensors",
            "rich", "triton", "pytest", "hypothesis", "tokenizers", "typing-extensions",
            "requests", "prometheus-client", "markdown-it-py", "pygments"}


def _pinned(listing: str) -> list[str]:
    lines = (GPU / listing).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _carried() -> set[str]:
    return {_canon(line.split("==")[0]) for line in _pinned("wheels.txt")}


def test_the_scripts_parse():
    for script in ("run.sh", "fetch-wheels.sh"):
        proc = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_every_wheel_is_pinned():
    for listing in ("wheels.txt", "titan-wheels.txt"):
        lines = _pinned(listing)
        assert lines and all("==" in line for line in lines), (listing, lines)


def _needs(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """The distributions `name` (installed here) needs on CPython 3.12 Linux, recursively,
    short of what the image has (its torch comes with what torch needs)."""
    found: set[str] = set()
    todo = [(name, extras)]
    while todo:
        dist, with_extras = todo.pop()
        for text in importlib.metadata.requires(dist) or []:
            req = Requirement(text)
            env = {"python_version": "3.12", "python_full_version": "3.12.3",
                   "platform_python_implementation": "CPython", "implementation_name":
                   "cpython", "sys_platform": "linux", "os_name": "posix"}
            if req.marker and not any(req.marker.evaluate({**env, "extra": e})
                                      for e in with_extras | {""}):
                continue
            if _canon(req.name) not in found:
                found.add(_canon(req.name))
                if _canon(req.name) not in {_canon(n) for n in IN_IMAGE}:
                    todo.append((req.name, frozenset(req.extras)))
    return found


def test_every_dependency_and_its_needs_reach_the_gpu_machine():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_canon(Requirement(d).name) for d in deps}
    for dep in wanted - {_canon(n) for n in IN_IMAGE}:
        wanted = wanted | _needs(dep)
    absent = sorted(wanted - {_canon(n) for n in IN_IMAGE} - _carried())
    assert not absent, (f"{absent}: on neither the GPU machine's image nor in "
                        "tests/gpu/wheels.txt; `lazarus up` there would fail to import them")


def test_a_missing_wheel_is_named_before_anything_is_installed(tmp_path):
    gpu = tmp_path / "tests" / "gpu"
    gpu.mkdir(parents=True)
    shutil.copy(GPU / "run.sh", gpu / "run.sh")
    shutil.copy(GPU / "wheels.txt", gpu / "wheels.txt")
    shutil.copy(GPU / "titan-wheels.txt", gpu / "titan-wheels.txt")
    (gpu / "wheels").mkdir()
    proc = subprocess.run(["bash", str(gpu / "run.sh")], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2
    assert "missing from tests/gpu/wheels: zstandard==0.25.0 aetcd==" in proc.stderr
    assert "torchtitan==0.2.2" in proc.stderr
    assert "fetch-wheels.sh" in proc.stderr
