"""Tokens/s of `lazarus train` on CPU against a plain single-process eager loop of the same
model, measured in the same run; prints the ratios. On demand only:

    pytest tests/bench/bench_train_throughput.py -m bench -s

The ratio is the cost (or gain) of the launcher, FSDP2, DTensor and the loader on this machine.
Every process runs one intra-op thread (the eager loop too): on a shared 2-core machine two
threads per process measured 30x slower for the tiny model than one, which would swamp what we
measure. With 2 processes each rank has one core, so 2 processes may beat the 1-thread eager loop.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from lazarus.core.stall import is_step
from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer

WARMUP = 2  # steps left out of every measurement (allocation, first-call overheads)
CASES = {  # model -> (seq_len, global_batch, steps)
    "tiny": (128, 8, 12),
    "small": (256, 8, 6),
}


def eager_tokens_per_s(model_name: str, seq_len: int, global_batch: int, steps: int) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _eager(model_name, seq_len, global_batch, steps)
    finally:
        torch.set_num_threads(threads)


def _eager(model_name: str, seq_len: int, global_batch: int, steps: int) -> float:
    torch.manual_seed(0)
    model = Transformer(get_model_config(model_name))
    model.init_weights(0)
    optimizer = build_optimizer(model, lr=1e-3)
    loader = SequenceLoader(TokenDataset(ensure_corpus(), seq_len), seed=0, global_batch=global_batch,
                            dp_rank=0, dp_size=1, micro_batch=global_batch)
    elapsed = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        [(inputs, targets)] = loader.next_step()
        model.loss(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP:
            elapsed += time.perf_counter() - t0
    return (steps - WARMUP) * global_batch * seq_len / elapsed


def lazarus_tokens_per_s(tmp_path, model_name: str, nproc: int, seq_len: int, global_batch: int,
                         steps: int) -> float:
    metrics = tmp_path / f"{model_name}-{nproc}.jsonl"
    subprocess.run([sys.executable, "-m", "lazarus.cli", "train", "--model", model_name, "--nproc", str(nproc),
                    "--dp", str(nproc), "--tp", "1", "--steps", str(steps), "--seq-len", str(seq_len),
                    "--global-batch", str(global_batch), "--metrics", str(metrics)],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   timeout=1800)
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if is_step(r)][WARMUP:]
    return sum(r["tokens"] for r in rows) / sum(r["step_time_s"] for r in rows)


@pytest.mark.bench
@pytest.mark.parametrize("model_name", list(CASES))
def test_throughput_ratio(tmp_path, model_name):
    seq_len, global_batch, steps = CASES[model_name]
    eager = eager_tokens_per_s(model_name, seq_len, global_batch, steps)
    print(f"\n{model_name}: eager single process {eager:,.0f} tok/s")
    for nproc in (1, 2):
        ours = lazarus_tokens_per_s(tmp_path, model_name, nproc, seq_len, global_batch, steps)
        print(f"{model_name}: lazarus train --nproc {nproc}: {ours:,.0f} tok/s, ratio {ours / eager:.2f}")
