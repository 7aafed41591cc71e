"""A multiprocessing context whose processes fork from one server that has imported torch,
its distributed packages and the checkpointer once per pytest process, for tests that start
gloo ranks of their own: a fresh interpreter per rank ("spawn") paid 3-4 CPU-s of imports
each, which on a two-core machine is most of such a test's time.

The server imports and runs nothing else, so it has no OpenMP pool or CUDA context a fork
would break (docs/constraints.md, "Worker starts"), the same rule as the agent's zygote. It
keeps the environment it started with: what a test's ranks need besides is `run_ranks`'s
`env`, set in each rank before the module that reads it is imported.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor", "safetensors.torch",
           "lazarus.trainer.checkpoint", "lazarus.trainer.exchange"]

# What torch's abort at exit prints (docs/constraints.md, "Aborts and hangs at exit").
ABORT_AT_EXIT = "terminate called without an active exception"

_lock = threading.Lock()
_context = None


def _ranks_context():
    """The forkserver context, its preload set before its server first starts."""
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        return _context


def _entry(env: dict[str, str], target: str, rank: int, out: str, args: tuple) -> None:
    # The environment first, then the target's module: TRITON_INTERPRET, for one, must be set
    # before any kernel is defined.
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        # OpenMP read the variable when the server imported torch: tell torch itself
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    err = os.open(Path(out, f"stderr-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(err, 2)
    os.close(err)
    try:
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(rank, *args)
        Path(out, f"done-{rank}").touch()
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(target: str, world: int, out, *args, env: dict[str, str] | None = None,
              timeout_s: float = 300) -> None:
    """Run `module:function`(rank, *args) in `world` forked processes with `env` added to their
    environment, all done within `timeout_s`; fail with the first rank's traceback, or how a
    rank ended otherwise. Every rank must exit 0, but for torch's abort at exit after its work
    (SIGABRT with ABORT_AT_EXIT on its stderr, its done marker written). A hang, or any other
    exit after the work, is a failure."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in [*out.glob("done-*"), *out.glob("error-*.txt")]:
        f.unlink()
    ctx = _ranks_context()
    procs = [ctx.Process(target=_entry, args=(env or {}, target, r, str(out), args))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = sorted(out.glob("error-*.txt"))
    assert not errors, errors[0].read_text()
    for rank, p in enumerate(procs):
        stderr = (out / f"stderr-{rank}.txt").read_text(errors="replace")[-2000:]
        done = (out / f"done-{rank}").exists()
        assert rank not in hung, (f"rank {rank} still ran after {timeout_s} s "
                                  f"({'after' if done else 'before'} its work): {stderr}")
        assert done, f"rank {rank} exited {p.exitcode} unfinished: {stderr}"
        torch_abort = p.exitcode == -signal.SIGABRT and ABORT_AT_EXIT in stderr
        assert p.exitcode == 0 or torch_abort, (f"rank {rank} exited {p.exitcode} after its "
                                                f"work: {stderr}")
