"""A user's own FSDP2 training loop that adopts Lazarus's trainer hooks: copy it as a start.

Run it with any torchrun launch (Lazarus's etcd rendezvous is the second); it trains on the
node's GPUs over NCCL where CUDA is, one per local rank, and on the CPU over gloo elsewhere:

    torchrun --standalone --nproc-per-node 2 trainer/examples/plain_fsdp.py --ckpt-dir /tmp/fsdp
    export LAZARUS_RDZV_KEY=$(openssl rand -hex 32)   # the same on every node of the job
    torchrun --rdzv-backend lazarus-etcd --rdzv-endpoint HOST:2379 --rdzv-id my-job \\
             --nnodes 1 --nproc-per-node 2 trainer/examples/plain_fsdp.py --ckpt-dir /tmp/fsdp

Started again with the same --ckpt-dir, it resumes from the newest committed checkpoint.

The lines that adopt Lazarus are marked `# lazarus`; in short:

    session = lazarus.trainer.connect()         # the node agent's channel, or alone without one
    guard = Guard(GuardConfig())                # NaN/Inf and loss or grad-norm spikes
    if guard.observe(loss, grad_norm) is None:  # a rejected batch updates nothing
        optimizer.step()
    session.report(step=step, loss=loss, grad_norm=grad_norm, tokens=n, step_time_s=dt)
    if session.should_checkpoint(step, every=N):     # periodic, or the daemon asked
        checkpointer.save(step, model, optimizer, extra,
                          commit_gate=session.may_commit,          # a stale round never commits
                          on_commit=session.checkpoint_committed,
                          on_fail=session.checkpoint_failed)

Without an agent (LAZARUS_AGENT_SOCKET unset) the reports go nowhere, every commit is allowed
and checkpoints follow --ckpt-every. Under a Lazarus agent the same lines let it see every
step, fence commits by rendezvous round and ask for a checkpoint before it moves the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lazarus.trainer
from lazarus.trainer.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
from lazarus.trainer.guard import Guard, GuardConfig

LAUNCH = "torchrun --standalone --nproc-per-node 2 trainer/examples/plain_fsdp.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A plain FSDP2 loop with Lazarus's trainer hooks "
                                f"(start it with torchrun: {LAUNCH}).")
    p.add_argument("--steps", type=int, default=30, help="train to this step")
    p.add_argument("--ckpt-dir", type=Path, help="commit checkpoints here and resume from them")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint period in steps")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--dim", type=int, default=16, help="width of the toy model")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to train: auto is cuda (NCCL) where CUDA is, else cpu (gloo)")
    args = p.parse_args(argv)
    for name in ("steps", "ckpt_every", "batch", "dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.lr > 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if "RANK" not in os.environ:
        p.error(f"not started by torchrun (RANK is unset); run: {LAUNCH}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device here")
    return args


def batch(step: int, rank: int, n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a fixed nonlinear regression task; a function of (step, rank) alone, so a
    resumed run sees the same data as the uninterrupted one."""
    teacher = torch.Generator().manual_seed(0)
    a, b = torch.randn(dim, dim, generator=teacher), torch.randn(dim, dim, generator=teacher)
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(step * 1000 + rank))
    return x, torch.tanh(x @ a) @ b / dim**0.5


def any_rank(flag: bool, device: torch.device) -> bool:
    # A save is collective: the daemon's request can reach the ranks' agents a step apart, so
    # every rank takes it if one has it.
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{world} ranks on {device.type} over {dist.get_backend()}", flush=True)
    torch.manual_seed(0)  # the same initial weights on every rank, before FSDP shards them
    hidden = 4 * args.dim
    model = nn.Sequential(nn.Linear(args.dim, hidden), nn.GELU(), nn.Linear(hidden, args.dim))
    model.to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    session = lazarus.trainer.connect()  # lazarus
    guard = Guard(GuardConfig())  # lazarus
    checkpointer = Checkpointer(args.ckpt_dir, keep_last=2) if args.ckpt_dir else None  # lazarus
    step = 0
    if args.ckpt_dir and (last := latest_checkpoint(args.ckpt_dir)):  # lazarus
        extra = load_checkpoint(last, model, optimizer)  # lazarus
        step = extra["step"]
        guard.load_state_dict(extra["guard"])  # lazarus: a resumed run judges as before
        if rank == 0:
            print(f"resumed from {last} at step {step}", flush=True)

    try:
        while step < args.steps:
            step += 1
            t0 = time.perf_counter()
            x, y = (t.to(device) for t in batch(step, rank, args.batch, args.dim))
            loss_t = nn.functional.mse_loss(model(x), y)
            loss_t.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
            loss_sum = loss_t.detach().clone()
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)  # gloo has no AVG
            loss, norm = loss_sum.item() / world, grad_norm.item()
            # Both values are global, so every rank's guard holds the same history and verdict.
            reason = guard.observe(loss, norm)  # lazarus
            if reason is None:
                optimizer.step()
            optimizer.zero_grad()
            dt = time.perf_counter() - t0
            session.report(step=step, loss=loss, grad_norm=norm, lr=args.lr,  # lazarus
                           tokens=args.batch * world,  # samples here: the model has no tokens
                           step_time_s=dt, skipped=reason is not None)
            if rank == 0:
                print(f"step {step} loss {loss:.5f} grad_norm {norm:.4f}"
                      + (f" skipped: {reason}" if reason else ""), flush=True)
            wanted = session.should_checkpoint(step, every=args.ckpt_every)  # lazarus
            if checkpointer is not None and any_rank(wanted or step == args.steps, device):
                extra = {"step": step, "guard": guard.state_dict()}
                checkpointer.save(step, model, optimizer, extra,  # lazarus
                                  commit_gate=session.may_commit,
                                  on_commit=session.checkpoint_committed,
                                  on_fail=session.checkpoint_failed)
        if checkpointer is not None:
            committed = checkpointer.wait()  # the last save commits before we say done
            if rank == 0:
                print(f"committed {committed}", flush=True)
    finally:
        if checkpointer is not None:
            checkpointer.close()
        session.close()  # lazarus
    if rank == 0:
        print(f"done at step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
