"""`lazarus preflight` as an operator runs it: a table (or JSON) of each check with its
time, exit 1 when one fails, one line and exit 2 on bad arguments; the collective test
between two nodes (two processes here), each given the same --peers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lazarus.agent.gpu_sim import add_fault
from lazarus.core.embedded_etcd import free_port
from tests.unit.test_cli_inputs import lazarus, one_error_line

ALL_BUT = {name: ",".join(c for c in ("gpu", "storage", "checkpoint", "clock", "collective")
                          if c != name)
           for name in ("gpu", "collective")}


def test_a_healthy_node_passes_and_prints_each_checks_time(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    proc = lazarus("preflight", "--gpu-backend", "sim", "--gpus", "2", "--workdir",
                   str(tmp_path), "--checkpoint-dir", str(ckpt), "--skip", "clock",
                   env={**os.environ, "COLUMNS": "400"})  # a row a line, whatever the path
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["CHECK", "RESULT", "TIME", "REASON"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == ["gpu", "storage", "checkpoint", "clock", "collective", "total"]
    assert [rows[c][1] for c in rows] == ["pass", "pass", "pass", "skipped", "pass", "pass"]
    assert all(rows[c][3] == "s" and float(rows[c][2]) >= 0 for c in rows)
    assert "2 GPUs healthy (sim)" in proc.stdout and "gloo all-reduce" in proc.stdout
    assert list(ckpt.iterdir()) == [] and list(tmp_path.iterdir()) == [ckpt]


def test_a_bad_gpu_fails_the_run_with_the_reason(tmp_path):
    faults = tmp_path / "faults.json"
    add_fault(faults, {"gpu": 0, "fault": "row-remap-pending"})
    proc = lazarus("preflight", "--gpu-backend", "sim", "--gpu-faults", str(faults),
                   "--workdir", str(tmp_path), "--skip", ALL_BUT["gpu"], "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["state"] == "failed"
    assert out["reason"] == ("gpu: GPU 0 failed: row remapping pending (the GPU needs a "
                             "reset)")
    assert [c["name"] for c in out["checks"] if not c["skipped"]] == ["gpu"]


def test_the_collective_test_between_two_nodes(tmp_path):
    """Each node judges the bandwidth by its own --min-bandwidth: rank 0 asks for more than
    any loopback gives and fails, rank 1 passes."""
    peers = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    floors = {0: "1000000", 1: "0.001"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "preflight", "--workdir", str(tmp_path),
         "--skip", ALL_BUT["collective"], "--host", "127.0.0.1", "--peers", peers, "--rank",
         str(rank), "--min-bandwidth", floors[rank], "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    for rank, p in zip((1, 0), procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == (0 if rank else 1), err  # 1: a check failed
        check = json.loads(out)["checks"][-1]
        assert check["name"] == "collective" and check["ok"] == (rank == 1), check
        assert check["reason"].startswith("gloo all-reduce of 8 MiB over 2 ranks: ")
        assert check["reason"].endswith("GB/s bus bandwidth" if rank else
                                        ", below 1e+06 GB/s"), check


@pytest.mark.parametrize("args, expect", [
    (["--skip", "gpu,disks"], "--skip: unknown check(s) disks (known: gpu, storage, "),
    (["--size-mb", "0"], "--size-mb must be above 0 and at most 1024, got 0"),
    (["--skew-limit", "-1"], "--skew-limit must be positive, got -1"),
    (["--peers", "127.0.0.1:5000"], "--peers needs at least two HOST:PORT entries"),
    (["--peers", "a:1,b:2", "--rank", "2"], "--rank 2 is not a place in --peers (0..1)"),
    (["--peers", "a:1,b"], "is not HOST:PORT"),
    (["--gpus", "-1"], "--gpus must not be negative, got -1"),
    (["--gpus", "many"], "argument --gpus: invalid int value: 'many'"),
    (["--workdir", "/nonexistent/x"], "--workdir /nonexistent/x is not a directory"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_one_line(args, expect, tmp_path):
    if "--workdir" not in args:
        args = [*args, "--workdir", str(tmp_path)]
    line = one_error_line(lazarus("preflight", "--gpu-backend", "sim", *args))
    assert line.startswith("lazarus preflight: error: ") and expect in line, line
