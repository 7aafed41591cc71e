"""`lazarus train`: train on this machine alone, like `torchrun --standalone`.

Everything a user can get wrong is checked before any process starts, so a bad job costs one
line and nothing on disk changes. Then the launcher imports the trainer once, forks one worker process per rank
(lazarus.trainer.forkranks), hosts the rendezvous store itself (a free port), hands each rank
its assignment, and stops them all as soon as one fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from lazarus.core import procstop, settings
from lazarus.core.batching import plan_batches
from lazarus.core.contract import ASSIGNMENT_ENV, NCCL_DEFAULTS, WorkerAssignment
from lazarus.core.errors import UserError
from lazarus.core.modelconfig import get_model_config
from lazarus.core.trainconfig import TrainConfig, load_toml
from lazarus.trainer import forkranks
from lazarus.trainer.ckptlist import latest_checkpoint, read_manifest  # no torch

# After one rank fails, how long the others get to exit on SIGTERM before SIGKILL.
STOP_GRACE_S = 5.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lazarus train", argument_default=argparse.SUPPRESS,
        description="Train on this machine. Settings come from --config JOB.toml ([train] "
                    "table and its sections) and flags; a flag overrides the file.")

    def setting(flag: str, dest: str, **kw) -> None:
        # dest is the setting's place in [train]: "section.key" (lazarus.core.trainconfig)
        if kw.get("action") not in ("store_true", "store_false"):
            kw.setdefault("metavar", dest.rpartition(".")[2].upper())
        kw["help"] = f"{kw['help']} [{dest}]" if "help" in kw else f"[{dest}]"
        p.add_argument(flag, dest=dest, **kw)

    p.add_argument("--config", metavar="JOB.toml", help="TOML job file with a [train] table")
    p.add_argument("--nproc", type=int, help="worker processes (default: dp x tp)")
    setting("--steps", "steps", type=int, help="optimizer steps to train to")
    setting("--seed", "seed", type=int)
    setting("--metrics", "metrics", metavar="FILE", help="append one JSON line per step to FILE")
    setting("--deterministic", "deterministic", action="store_true",
            help="deterministic kernels: a resumed run repeats the uninterrupted one bit for "
                 "bit on CUDA too (slower; docs/gpus.md)")
    setting("--peak-tflops", "peak_tflops", type=float,
            help="the accelerator's bf16 dense peak for the MFU figure (default: by its name)")
    setting("--model", "model.name", help="model size: tiny, small, 1b, 8b")
    setting("--fused-kernels", "model.fused_kernels", action="store_true", help="use the Triton kernels")
    setting("--dp", "parallelism.dp", type=int, help="data-parallel degree (default: nproc / tp)")
    setting("--tp", "parallelism.tp", type=int, help="tensor-parallel degree (default 1)")
    setting("--activation-checkpointing", "parallelism.activation_checkpointing", action="store_true")
    setting("--compile", "parallelism.compile", action="store_true", help="torch.compile each block")
    setting("--lr", "optimizer.lr", type=float, help="peak learning rate")
    setting("--min-lr", "optimizer.min_lr", type=float, help="final learning rate")
    setting("--warmup-steps", "optimizer.warmup_steps", type=int)
    setting("--schedule", "optimizer.schedule", help="cosine or wsd (warmup-stable-decay)")
    setting("--lr-scale", "optimizer.lr_scale", type=float,
            help="multiply the lr by this for --lr-scale-steps steps")
    setting("--lr-scale-steps", "optimizer.lr_scale_steps", type=int,
            help="steps after the start (or restore) step that --lr-scale covers")
    setting("--data", "data.dir", metavar="DIR", help="corpus directory (default: the built-in stdlib corpus)")
    setting("--global-batch", "data.global_batch", type=int,
            help="sequences per optimizer step, fixed whatever dp is")
    setting("--micro-batch", "data.micro_batch", type=int, help="sequences per forward pass (default: derived)")
    setting("--seq-len", "data.seq_len", type=int, help="tokens per sequence")
    setting("--skip-window", "data.skip_windows", action="append", metavar="FIRST:LAST",
            help="never train on data cursors FIRST..LAST (inclusive; a spike's window); repeatable")
    setting("--ckpt-dir", "checkpoint.dir", metavar="DIR")
    setting("--ckpt-every", "checkpoint.every", type=int, help="checkpoint every N steps (0: at the end only)")
    setting("--keep-last", "checkpoint.keep_last", type=int, help="committed checkpoints to keep")
    setting("--resume", "checkpoint.resume", nargs="?", const="latest", metavar="CHECKPOINT",
            help="continue from CHECKPOINT, or without a value from the newest committed one in --ckpt-dir")
    setting("--sync-checkpoint", "checkpoint.async_save", action="store_false",
            help="block training while a checkpoint is written")
    setting("--guard-window", "guard.window", type=int,
            help="accepted steps the loss and grad-norm trends are fitted over (default 20)")
    setting("--guard-threshold", "guard.threshold", type=float,
            help="robust z-score above its trend (in the run's own noise) that makes the loss alone a spike (default 5)")
    setting("--guard-min-history", "guard.min_history", type=int,
            help="accepted steps before any spike verdict (default 8)")
    setting("--guard-grad-ratio", "guard.grad_ratio", type=float,
            help="the grad norm alone is a spike from this many times its trend (default 5)")
    setting("--guard-loss-ratio", "guard.loss_ratio", type=float,
            help="the smallest loss spike, in times its trend (default 1.3)")
    return p


def job_from_args(argv: list[str]) -> tuple[TrainConfig, int]:
    """The validated job and the number of processes, from a job file and flags."""
    args = vars(_parser().parse_args(argv))
    settings = load_toml(args.pop("config")) if "config" in args else {}
    nproc = args.pop("nproc", None)
    if "data.skip_windows" in args:
        args["data.skip_windows"] = [_cursor_span(text) for text in args["data.skip_windows"]]
    for dotted, value in args.items():
        section, _, key = dotted.rpartition(".")
        table = settings.setdefault(section, {}) if section else settings
        if isinstance(table, dict):  # else from_dict names the section that is no table
            table[key] = value
    par = settings.get("parallelism", {})
    if nproc is not None and isinstance(par, dict) and "dp" not in par:
        tp = par.get("tp", 1)
        if isinstance(tp, int) and tp > 0 and nproc % tp == 0:
            settings["parallelism"] = {**par, "dp": nproc // tp}
    cfg = TrainConfig.from_dict(settings)
    dp, tp = cfg.parallelism.dp, cfg.parallelism.tp
    nproc = dp * tp if nproc is None else nproc
    if dp * tp != nproc:
        raise UserError(f"mesh dp={dp} x tp={tp} = {dp * tp} ranks does not match --nproc {nproc}")
    return cfg, nproc


def _cursor_span(text: str) -> list[int]:
    first, _, last = text.partition(":")
    try:
        return [int(first), int(last)]
    except ValueError:
        raise UserError(f"--skip-window {text!r} must be FIRST:LAST (two data cursors)") from None


def check_inputs(cfg: TrainConfig) -> str | None:
    """Check the data and checkpoints the job names; returns the checkpoint to restore."""
    # here: it loads torch; main() forks only when torch was not loaded before it ran
    from lazarus.trainer.corpus import ensure_corpus
    from lazarus.trainer.data import TokenDataset, check_model_vocab

    data, ck = cfg.data, cfg.checkpoint
    if cfg.model.fused_kernels:
        from lazarus.trainer.models.llama import select_ops  # here: loads torch, as above

        select_ops(fused=True)  # UserError here, not in every rank, if the kernels are missing
    dataset = TokenDataset(ensure_corpus(Path(data.dir) if data.dir else None), data.seq_len)
    check_model_vocab(dataset, get_model_config(cfg.model.name).vocab_size, cfg.model.name)
    if data.global_batch > len(dataset):
        raise UserError(f"global batch {data.global_batch} is larger than the corpus "
                        f"({len(dataset)} sequences of {data.seq_len + 1} tokens)")
    if ck.resume is None:
        if ck.dir is not None and latest_checkpoint(Path(ck.dir)) is not None:
            raise UserError(f"{ck.dir} already holds checkpoints: pass --resume to continue "
                            f"that run, or choose another --ckpt-dir")
        return None
    if ck.resume == "latest":
        found = latest_checkpoint(Path(ck.dir))
        if found is None:
            raise UserError(f"--resume: no committed checkpoint in {ck.dir}")
        return str(found)
    read_manifest(Path(ck.resume))  # committed? (the workers verify checksums as they load)
    return ck.resume


def rank_env(nproc: int) -> dict[str, str]:
    return {**NCCL_DEFAULTS, **os.environ, **settings.rank_threads_env(nproc)}


def _assignment(cfg: TrainConfig, nproc: int, rank: int, *, restore: str | None,
                store_port: int, round: int = 0) -> WorkerAssignment:
    return WorkerAssignment(rank=rank, world_size=nproc, local_rank=rank, round=round,
                            store_host="127.0.0.1", store_port=store_port,
                            train=cfg.to_dict(), restore=restore)


def spawn_workers(cfg: TrainConfig, nproc: int, *, restore: str | None, store_port: int,
                  round: int = 0) -> list[subprocess.Popen]:
    """Cold workers: each its own interpreter and imports."""
    env = rank_env(nproc)
    return [subprocess.Popen([sys.executable, "-m", "lazarus.cli", "worker"],
                             env={**env, ASSIGNMENT_ENV: _assignment(
                                 cfg, nproc, rank, restore=restore, store_port=store_port,
                                 round=round).to_json()},
                             preexec_fn=forkranks.die_with_parent)
            for rank in range(nproc)]


def supervise(procs: list[subprocess.Popen]) -> int:
    """Wait for every rank; on the first failure stop the others. Returns the job's exit code."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                procstop.stop_all(procs, STOP_GRACE_S)
                print(f"lazarus train: rank {rank} exited with code {code}; stopped the other ranks",
                      file=sys.stderr)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    except KeyboardInterrupt:
        procstop.stop_all(procs, STOP_GRACE_S)
        return 130


def main(argv: list[str]) -> int:
    imported_before = "torch" in sys.modules  # see lazarus.trainer.forkranks
    cfg, nproc = job_from_args(argv)
    restore = check_inputs(cfg)

    forked = forkranks.prepare(rank_env(nproc), imported_before=imported_before)
    import torch.distributed as dist

    if cfg.metrics and restore is None:
        Path(cfg.metrics).write_text("")  # a fresh run starts a fresh metrics file
    data, dp, tp = cfg.data, cfg.parallelism.dp, cfg.parallelism.tp
    plan = plan_batches(data.global_batch, dp, data.micro_batch)
    print(f"lazarus train: model {cfg.model.name} ({get_model_config(cfg.model.name).num_params():,} params), "
          f"dp {dp} x tp {tp}, global batch {data.global_batch} = micro {plan.micro_batch} x "
          f"dp {dp} x accumulation {plan.accumulation}, seq_len {data.seq_len}, {cfg.steps} steps",
          flush=True)
    if not forked:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return supervise(spawn_workers(cfg, nproc, restore=restore, store_port=store.port))
    # Forked before the store's server thread exists; each rank waits for its assignment.
    ranks = forkranks.fork_ranks(nproc)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for rank, child in enumerate(ranks):
        child.hand(_assignment(cfg, nproc, rank, restore=restore, store_port=store.port).to_json())
    return supervise(ranks)
