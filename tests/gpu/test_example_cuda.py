"""trainer/examples/plain_fsdp.py, the loop a user copies to adopt Lazarus, on a GPU as a user
runs it: torchrun, NCCL, FSDP2 shards on CUDA, Lazarus's checkpointer (DCP) saving from and
loading onto the device. A run stopped at step 10 and started again with the same --ckpt-dir
goes on with the uninterrupted run's losses, bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lazarus.trainer.ckptlist import latest_checkpoint
from lazarus.trainer.ckptverify import verify_checkpoint

SCRIPT = Path(__file__).parents[2] / "trainer" / "examples" / "plain_fsdp.py"
STEP_LINE = re.compile(r"^step (\d+) loss (\S+) grad_norm (\S+)$", re.M)


def launch(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", str(SCRIPT), "--dim", "256", "--batch", "64", *args]
    # cuBLAS picks the same kernels run after run only with a fixed workspace.
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def losses(out: str) -> dict[int, str]:
    return {int(step): loss for step, loss, _ in STEP_LINE.findall(out)}


def test_the_users_loop_trains_on_nccl_and_resumes_bit_for_bit(tmp_path):
    whole = launch("--steps", "20", "--ckpt-every", "10", "--ckpt-dir", str(tmp_path / "a"))
    assert "1 ranks on cuda over nccl" in whole, whole
    first = launch("--steps", "10", "--ckpt-every", "10", "--ckpt-dir", str(tmp_path / "b"))
    last = latest_checkpoint(tmp_path / "b")
    assert last is not None and last.name.endswith("10"), last
    verify_checkpoint(last)  # manifest and every file's checksum, or RestoreFailed
    second = launch("--steps", "20", "--ckpt-every", "10", "--ckpt-dir", str(tmp_path / "b"))
    assert "resumed from" in second and "at step 10" in second, second
    ref, got = losses(whole), {**losses(first), **losses(second)}
    assert sorted(got) == list(range(1, 21)), got
    assert got == ref, {s: (ref[s], got[s]) for s in ref if ref[s] != got[s]}
