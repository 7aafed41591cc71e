"""A script's teardown of its process groups, bounded in time.

torch's `destroy_process_group()` hangs now and then at the end of a run (pytorch/pytorch
issue 75097, open since 2022): a gloo worker thread still holding a finished work's tensors
needs the interpreter lock that the destroying thread holds while it joins it. Seen here once
in a CI run: both ranks of a level-0 script printed their last epoch, then neither ever
exited, so the run stayed RUNNING and its nodes were held for good. torchrun hangs the same.

The rank runner (lazarus.trainer.rankrun) therefore wraps it for the script: when destroying
every group has not returned within `GRACE_S`, the rank prints why, with every thread's stack,
and ends with exit code 0 -- every collective is done by then, and a rank that cannot leave
teardown can do nothing more. Destroying one group (`group=` given) is left alone: a script
that goes on afterwards still needs its other groups.
"""

from __future__ import annotations

import faulthandler
import functools
import sys
import threading
from collections.abc import Callable

from lazarus.trainer import exitnote

# Tearing down gloo or NCCL groups takes milliseconds to a few seconds; a minute is a hang.
GRACE_S = 60.0


def _hung(grace_s: float) -> None:
    print(f"lazarus: torch.distributed.destroy_process_group() did not return in "
          f"{grace_s:.0f} s (a known torch hang at teardown, pytorch/pytorch#75097); the "
          f"script's collectives are done, so this rank exits 0. Its threads:",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    exitnote.exit_now(0)  # not the atexit handlers: they may wait on the same lock


def bound_destroy(grace_s: float = GRACE_S, *,
                  on_hang: Callable[[float], None] = _hung) -> None:
    """Make `torch.distributed.destroy_process_group()` (all groups) end the process with
    `on_hang(grace_s)` when it does not return within `grace_s`. Idempotent."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_lazarus_bounded", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        if group is not None:
            return original(group)
        returned = threading.Event()

        def watch() -> None:
            if not returned.wait(grace_s):
                on_hang(grace_s)

        threading.Thread(target=watch, daemon=True, name="lazarus-teardown").start()
        try:
            return original(group)
        finally:
            returned.set()

    destroy_process_group._lazarus_bounded = True
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
