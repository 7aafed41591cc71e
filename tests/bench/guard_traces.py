"""Loss and gradient-norm traces of real CPU training runs, for the guard benchmark to replay.

    python -m tests.bench.guard_traces OUT_DIR SPEC_JSON [SPEC_JSON ...]

Each SPEC is {"model", "seq_len", "global_batch", "steps", "seed", "lr"} and optionally
"probe": false and "total_steps" (the length of the learning-rate schedule, default "steps": a
long schedule keeps the rate at its peak, as in the first part of a long run); each run writes OUT_DIR/<name>.json: per step the loss and grad norm of the
batch trained on, and (unless "probe" is false) at the probe steps the loss and grad norm a
poisoned copy of that batch would have had at the same weights (measured, then thrown away:
the run itself never sees it).

The poison is lazarus.sim.trainer_faults' (a garbage token repeated over the whole sequence,
ids from the upper half of the vocabulary), put into a share of the batch's sequences, so one
run yields real spikes of several sizes. The training step is the trainer's own
(lazarus.trainer.train: forward_backward, finish_step, lr_at) on a one-rank gloo group, with
every step applied: the guard is replayed afterwards.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path

# Shares of the batch's sequences the probes poison.
POISON_SHARES = (0.125, 0.5, 1.0)


def probe_steps(steps: int) -> list[int]:
    """Steps at which the poisoned copies are measured: densely early, where judging is hard."""
    early = [10, 11, 12, 13, 15, 20, 25, 30, 40, 50]
    return [s for s in early if s <= steps] + list(range(75, steps + 1, 25))


def name_of(spec: dict) -> str:
    total = f"-T{spec['total_steps']}" if "total_steps" in spec else ""
    return (f"{spec['model']}-s{spec['seq_len']}-b{spec['global_batch']}-lr{spec['lr']:g}"
            f"-seed{spec['seed']}-n{spec['steps']}{total}")


def record(spec: dict) -> dict:
    import torch

    from lazarus.core.batching import plan_batches
    from lazarus.core.modelconfig import get_model_config
    from lazarus.core.trainconfig import ParallelConfig
    from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
    from lazarus.trainer.optim import ScheduleConfig, build_optimizer, lr_at, set_lr
    from lazarus.trainer.parallelize import build_mesh, build_model
    from lazarus.trainer.train import finish_step, forward_backward

    torch.manual_seed(spec["seed"])
    model_cfg = get_model_config(spec["model"])
    mesh = build_mesh("cpu", dp=1, tp=1)
    model = build_model(model_cfg, mesh, ParallelConfig(), seed=spec["seed"])
    optimizer = build_optimizer(model, lr=spec["lr"])
    plan = plan_batches(spec["global_batch"], 1, None)
    loader = SequenceLoader(TokenDataset(ensure_corpus(), spec["seq_len"]), seed=spec["seed"],
                            global_batch=spec["global_batch"], dp_rank=0, dp_size=1,
                            micro_batch=plan.micro_batch)
    schedule = ScheduleConfig(schedule="cosine", lr=spec["lr"], min_lr=min(spec["lr"], 1e-4),
                              warmup_steps=10,
                              total_steps=spec.get("total_steps", spec["steps"]))
    group = mesh["dp"].get_group()
    probes = set(probe_steps(spec["steps"])) if spec.get("probe", True) else set()
    loss, grad_norm, poisoned = [], [], {}
    t0 = time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        set_lr(optimizer, lr_at(step, schedule))
        batch = loader.next_step()
        if step in probes:
            poisoned[step] = []
            for share in POISON_SHARES:
                bad = poison(batch, share, vocab_size=model_cfg.vocab_size, seed=step)
                l_t, n_t = forward_backward(model, bad, device=torch.device("cpu"), loss_group=group)
                finish_step(model, optimizer, n_t, grad_clip=1.0, apply=False)
                poisoned[step].append([share, l_t.item(), n_t.item()])
        l_t, n_t = forward_backward(model, batch, device=torch.device("cpu"), loss_group=group)
        finish_step(model, optimizer, n_t, grad_clip=1.0, apply=True)
        loss.append(l_t.item())
        grad_norm.append(n_t.item())
        if not (math.isfinite(loss[-1]) and math.isfinite(grad_norm[-1])):
            break  # the run is lost: nothing after this is training
    return {"spec": spec, "loss": loss, "grad_norm": grad_norm, "poisoned": poisoned,
            "seconds": time.perf_counter() - t0}


def poison(batch, share: float, *, vocab_size: int, seed: int):
    """`batch` with its first `share` of sequences replaced by trainer_faults' garbage."""
    import torch

    inputs = torch.cat([x for x, _ in batch])
    targets = torch.cat([y for _, y in batch])
    rows = torch.cat([inputs, targets[:, -1:]], dim=1)
    n = max(1, round(share * rows.shape[0]))
    gen = torch.Generator().manual_seed(seed)
    garbage = torch.randint(vocab_size // 2, vocab_size, (n, 1), generator=gen)
    rows = torch.cat([garbage.expand(-1, rows.shape[1]), rows[n:]])
    sizes = [x.shape[0] for x, _ in batch]
    return [(part[:, :-1], part[:, 1:]) for part in rows.split(sizes)]


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world_size=1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    for text in argv[1:]:
        spec = json.loads(text)
        trace = record(spec)
        (out / f"{name_of(spec)}.json").write_text(json.dumps(trace))
        print(f"{name_of(spec)}: {len(trace['loss'])} steps in {trace['seconds']:.0f} s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
