"""The trainer on CUDA: a run on NCCL reports MFU and peak memory; deterministic mode resumes
bit for bit; the tier-0 snapshot period is agreed over NCCL; NCCL's flight recorder shows a
collective stalled behind the GPU. One GPU: every run here is one rank (NCCL cannot put two
ranks of one communicator on one GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _env() -> dict:
    return {**os.environ, "LAZARUS_DEVICE": "cuda"}


def lazarus_train(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "train", "--nproc", "1", *args],
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_cuda_run_reports_mfu_and_peak_memory(tmp_path):
    metrics = tmp_path / "m.jsonl"
    lazarus_train(["--model", "small", "--steps", "12", "--seq-len", "512", "--global-batch", "8",
                   "--metrics", str(metrics)])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 12
    assert all(0 < r["mfu"] < 1 and r["peak_mem_gib"] > 0 for r in steps), steps[-1]
    assert steps[-1]["loss"] < steps[0]["loss"]


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_deterministic_mode_resumes_bit_for_bit(tmp_path, fused):
    common = ["--model", "small", "--seq-len", "256", "--global-batch", "8", "--deterministic",
              "--sync-checkpoint", "--ckpt-every", "6", *(["--fused-kernels"] if fused else [])]
    whole, split = tmp_path / "whole.jsonl", tmp_path / "split.jsonl"
    lazarus_train([*common, "--steps", "12", "--metrics", str(whole),
                   "--ckpt-dir", str(tmp_path / "a")])
    lazarus_train([*common, "--steps", "6", "--metrics", str(split),
                   "--ckpt-dir", str(tmp_path / "b")])
    lazarus_train([*common, "--steps", "12", "--metrics", str(split),
                   "--ckpt-dir", str(tmp_path / "b"), "--resume"])
    a, b = _losses(whole), _losses(split)
    assert set(a) == set(range(1, 13)) and set(b) == set(a)
    assert [a[s] for s in range(7, 13)] == [b[s] for s in range(7, 13)], (a, b)


def _run_script(code: str, tmp_path: Path, extra_env: dict | None = None) -> str:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(code))
    proc = subprocess.run([sys.executable, str(script)], env={**_env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


ONE_RANK_NCCL = """
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
"""


def test_the_automatic_snapshot_period_is_agreed_over_nccl(tmp_path):
    out = _run_script(ONE_RANK_NCCL + """
from lazarus.trainer import snapshot as tier0
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer
model = Transformer(get_model_config("tiny")).to_empty(device="cuda")
model.init_weights(seed=0)
opt = build_optimizer(model, lr=1e-3)
model(torch.zeros(1, 8, dtype=torch.long, device="cuda")).sum().backward()
opt.step()
written = []
snaps = tier0.Snapshotter(os.getcwd(), every=0, header={"rank": 0, "world_size": 1},
                          on_written=lambda step, path: written.append(path), first_step=0)
for step in (1, 2, 3):
    snaps.observe_step(0.1)
    snaps.take(step, model, opt, {"step": step})
snaps.close()
print("written", len(written), "next", snaps.next_step)
dist.destroy_process_group()
""", tmp_path)
    assert "written 3" in out


def test_ncclS_flight_record_shows_a_collective_stalled_behind_the_gpu(tmp_path):
    out = _run_script(ONE_RANK_NCCL + """
import time
from pathlib import Path
from lazarus.agent.stacks import describe_flight
from lazarus.trainer.flightrec import write_record
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
time.sleep(2)                           # NCCL's watchdog marks completions as it polls
torch.cuda._sleep(12_000_000_000)       # some 6 s of the GPU busy before the next one
dist.all_reduce(x)                      # enqueued, not started: stalled behind the GPU
time.sleep(2)
write_record(Path("record.json"))
print("STALLED", describe_flight(Path("record.json").read_bytes()))
torch.cuda.synchronize()
time.sleep(2)
write_record(Path("record.json"))
print("DONE", describe_flight(Path("record.json").read_bytes()))
dist.destroy_process_group()
""", tmp_path, {"TORCH_FR_BUFFER_SIZE": "64"})
    stalled = next(line for line in out.splitlines() if line.startswith("STALLED"))
    done = next(line for line in out.splitlines() if line.startswith("DONE"))
    assert "#2 all_reduce enqueued, #1 completed" in stalled, out
    assert "#2 all_reduce enqueued, #2 completed" in done, out
