"""A parked worker forked from the agent's zygote (lazarus.trainer.zygote) trains on the GPU: the
zygote imported torch and the trainer without touching the CUDA driver, so its child may."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch.distributed as dist

from lazarus.agent.workers import Workers
from lazarus.agent.zygote import ForkedWorker
from lazarus.core.contract import WorkerAssignment, round_port_key
from lazarus.core.trainconfig import DataConfig, TrainConfig


def test_a_worker_forked_from_the_zygote_trains_on_cuda(tmp_path):
    w = Workers(nproc=1, env={**os.environ, "LAZARUS_DEVICE": "cuda"}, log_dir=tmp_path / "logs",
                notes_dir=tmp_path / "notes", park=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    round_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(round_port_key(3), str(round_store.port))
    try:
        deadline = time.monotonic() + 120
        while not w.parked and time.monotonic() < deadline:
            w.refill()
            time.sleep(0.05)
        (worker,) = w.parked
        assert isinstance(worker, ForkedWorker)
        metrics = tmp_path / "m.jsonl"
        train = TrainConfig(steps=4, data=DataConfig(seq_len=128, global_batch=4),
                            metrics=str(metrics)).to_dict()
        group = w.launch(3, {0: WorkerAssignment(rank=0, world_size=1, local_rank=0, round=3,
                                                  store_host="127.0.0.1", store_port=store.port,
                                                  train=train)})
        deadline = time.monotonic() + 180
        while group.alive and time.monotonic() < deadline:
            w.poll()
            time.sleep(0.1)
        logs = "\n".join(p.read_text(errors="replace")[-3000:]
                         for p in (tmp_path / "logs").rglob("*.log"))
        assert group.exit_codes == {0: 0}, logs
        steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        assert len(steps) == 4 and all(r["peak_mem_gib"] > 0 for r in steps), steps
    finally:
        w.shutdown()


def test_the_fork_check_tells_a_mapped_driver_from_an_initialised_one():
    # torch's CUDA libraries map libcuda at import (cuBLASLt dlopens it on torch 2.11+cu130):
    # forking is still safe then, and must stop being so once the driver has run cuInit.
    script = ("from lazarus.trainer.zygote import import_for_fork, driver_initialised\n"
              "import torch\n"
              "print(import_for_fork(), driver_initialised())\n"
              "torch.cuda.init()\n"
              "print(driver_initialised())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LAZARUS_DEVICE": "cuda"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "False", "True"], proc.stdout
