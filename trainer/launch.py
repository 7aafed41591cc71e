"""`lazarus train`: train on this machine alone, like `torchrun --standalone`.

Everything a user can get wrong is checked before any process starts, so a bad job costs one
line and nothing on disk changes. Then the launcher hosts the rendezvous store itself (a free
port), starts one worker process per rank, and stops them all as soon as one fails.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.trainer.config import TrainConfig, load_toml
from lazarus.core.contract import ASSIGNMENT_ENV, WorkerAssignment

# After one rank fails, how long the others get to exit on SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lazarus train", argument_default=argparse.SUPPRESS,
        description="Train on this machine. Settings come from --config JOB.toml ([train] "
                    "table) and flags; a flag overrides the file.")
    p.add_argument("--config", metavar="JOB.toml", help="TOML job file with a [train] table")
    p.add_argument("--nproc", type=int, help="worker processes (default: dp x tp)")
    p.add_argument("--dp", type=int, help="data-parallel degree (default: nproc / tp)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    p.add_argument("--model", help="model size: tiny, small, 1b, 8b")
    p.add_argument("--steps", type=int, help="optimizer steps to train to")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step, fixed whatever dp is")
    p.add_argument("--micro-batch", type=int, help="sequences per forward pass (default: derived)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--min-lr", type=float, help="final learning rate")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--schedule", help="cosine or wsd (warmup-stable-decay)")
    p.add_argument("--seed", type=int)
    p.add_argument("--data", metavar="DIR", help="corpus directory (default: the built-in stdlib corpus)")
    p.add_argument("--ckpt-dir", metavar="DIR")
    p.add_argument("--ckpt-every", type=int, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--keep-last", type=int, help="committed checkpoints to keep")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from CHECKPOINT, or without a value from the newest committed one in --ckpt-dir")
    p.add_argument("--metrics", metavar="FILE", help="append one JSON line per step to FILE")
    p.add_argument("--fused-kernels", action="store_true", help="use the Triton kernels")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--sync-checkpoint", dest="async_checkpoint", action="store_false",
                   help="block training while a checkpoint is written")
    p.add_argument("--guard-window", type=int, help="accepted steps the spike statistics cover (default 50)")
    p.add_argument("--guard-threshold", type=float,
                   help="robust z-score (median/MAD) above which a loss or grad norm is a spike (default 6)")
    p.add_argument("--guard-min-history", type=int, help="accepted steps before any spike verdict (default 25)")
    p.add_argument("--skip-window", dest="skip_windows", action="append", metavar="FIRST:LAST",
                   help="never train on data cursors FIRST..LAST (inclusive; a spike's window); repeatable")
    p.add_argument("--lr-scale", type=float, help="multiply the lr by this for --lr-scale-steps steps")
    p.add_argument("--lr-scale-steps", type=int, help="steps after the start (or restore) step that --lr-scale covers")
    p.add_argument("--inject", action="append", metavar="KIND@STEP",
                   help="fault injection: loss-spike@STEP (a poisoned batch) or diverge@STEP (poisoned data for "
                        "several steps); repeatable")
    return p


def job_from_args(argv: list[str]) -> tuple[TrainConfig, int]:
    """The validated job and the number of processes, from a job file and flags."""
    args = vars(_parser().parse_args(argv))
    settings = load_toml(args.pop("config")) if "config" in args else {}
    nproc = args.pop("nproc", None)
    if "skip_windows" in args:
        args["skip_windows"] = [_cursor_span(text) for text in args["skip_windows"]]
    settings.update(args)
    if nproc is not None and "dp" not in settings:
        tp = settings.get("tp", 1)
        if isinstance(tp, int) and tp > 0 and nproc % tp == 0:
            settings["dp"] = nproc // tp
    cfg = TrainConfig.from_dict(settings)
    nproc = cfg.dp * cfg.tp if nproc is None else nproc
    if cfg.dp * cfg.tp != nproc:
        raise UserError(f"mesh dp={cfg.dp} x tp={cfg.tp} = {cfg.dp * cfg.tp} ranks does not match --nproc {nproc}")
    return cfg, nproc


def _cursor_span(text: str) -> list[int]:
    first, _, last = text.partition(":")
    try:
        return [int(first), int(last)]
    except ValueError:
        raise UserError(f"--skip-window {text!r} must be FIRST:LAST (two data cursors)") from None


def check_inputs(cfg: TrainConfig) -> str | None:
    """Check the data and checkpoints the job names; returns the checkpoint to restore."""
    from lazarus.trainer import checkpoint as ckpt
    from lazarus.trainer.data import TokenDataset, ensure_corpus

    if cfg.fused_kernels:
        from lazarus.trainer.models.llama import select_ops

        select_ops(fused=True)  # UserError here, not in every rank, if the kernels are missing
    dataset = TokenDataset(ensure_corpus(Path(cfg.data) if cfg.data else None), cfg.seq_len)
    if cfg.global_batch > len(dataset):
        raise UserError(f"global batch {cfg.global_batch} is larger than the corpus "
                        f"({len(dataset)} sequences of {cfg.seq_len + 1} tokens)")
    if cfg.resume is None:
        if cfg.ckpt_dir is not None and ckpt.latest_checkpoint(Path(cfg.ckpt_dir)) is not None:
            raise UserError(f"{cfg.ckpt_dir} already holds checkpoints: pass --resume to continue "
                            f"that run, or choose another --ckpt-dir")
        return None
    if cfg.resume == "latest":
        found = ckpt.latest_checkpoint(Path(cfg.ckpt_dir))
        if found is None:
            raise UserError(f"--resume: no committed checkpoint in {cfg.ckpt_dir}")
        return str(found)
    ckpt.read_manifest(Path(cfg.resume))  # committed? (the workers verify checksums as they load)
    return cfg.resume


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a worker must not outlive a launcher that was killed.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def spawn_workers(cfg: TrainConfig, nproc: int, *, restore: str | None, store_port: int,
                  round: int = 0) -> list[subprocess.Popen]:
    env = dict(os.environ)
    # One process per core is what a rank can use; torch would otherwise start a thread per core
    # in every rank and oversubscribe the machine.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    procs = []
    for rank in range(nproc):
        assignment = WorkerAssignment(rank=rank, world_size=nproc, local_rank=rank, round=round,
                                      store_host="127.0.0.1", store_port=store_port,
                                      train=cfg.to_dict(), restore=restore)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "worker"],
            env={**env, ASSIGNMENT_ENV: assignment.to_json()}, preexec_fn=_die_with_parent))
    return procs


def supervise(procs: list[subprocess.Popen]) -> int:
    """Wait for every rank; on the first failure stop the others. Returns the job's exit code."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                _stop(procs)
                print(f"lazarus train: rank {rank} exited with code {code}; stopped the other ranks",
                      file=sys.stderr)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str]) -> int:
    cfg, nproc = job_from_args(argv)
    restore = check_inputs(cfg)

    import torch.distributed as dist

    from lazarus.trainer.batching import plan_batches
    from lazarus.trainer.models import get_model_config

    if cfg.metrics and restore is None:
        Path(cfg.metrics).write_text("")  # a fresh run starts a fresh metrics file
    plan = plan_batches(cfg.global_batch, cfg.dp, cfg.micro_batch)
    print(f"lazarus train: model {cfg.model} ({get_model_config(cfg.model).num_params():,} params), "
          f"dp {cfg.dp} x tp {cfg.tp}, global batch {cfg.global_batch} = micro {plan.micro_batch} x "
          f"dp {cfg.dp} x accumulation {plan.accumulation}, seq_len {cfg.seq_len}, {cfg.steps} steps",
          flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return supervise(spawn_workers(cfg, nproc, restore=restore, store_port=store.port))
