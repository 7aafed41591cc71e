"""The checkpoint part of preflight: a small state dict saved and loaded through
torch.distributed.checkpoint, the trainer's path to storage, in the job's checkpoint dir.
Run in the agent (lazarus.agent.preflight) or, where the job's user must write there, in a
child of the zygote (lazarus.agent.collective_check)."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

MiB = 1 << 20


def os_error(e: OSError) -> str:
    code = errno.errorcode.get(e.errno, "error") if e.errno else type(e).__name__
    return f"{code}: {e.strerror or e}"


def checkpoint_round_trip(directory: Path) -> tuple[bool, str]:
    """Save a small state dict with torch.distributed.checkpoint (as the trainer saves its
    shards), load it into zeroed tensors, compare, remove it."""
    import torch  # lazily: `lazarus preflight --skip checkpoint` need not load torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if not directory.is_dir():
        return True, f"skipped: {directory} not there yet"
    gen = torch.Generator().manual_seed(os.getpid())
    state = {"weight": torch.randn(512, 512, generator=gen), "step": torch.tensor(7)}
    try:
        target = Path(tempfile.mkdtemp(prefix=".lazarus-preflight-", dir=directory))
    except OSError as e:
        return False, f"{directory}: {os_error(e)}"
    try:
        dcp.save(state, checkpoint_id=target, no_dist=True)
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(back, checkpoint_id=target, no_dist=True)
        size = sum(p.stat().st_size for p in target.iterdir())
    except OSError as e:
        return False, f"{directory}: {os_error(e)}"
    except CheckpointException as e:
        # DCP wraps the storage's error (a BaseException, not an OSError): the first says it
        first = next(iter(e.failures.values()), None)
        cause = first[0] if isinstance(first, tuple) else first
        return False, f"{directory}: " + (os_error(cause) if isinstance(cause, OSError)
                                          else f"DCP: {cause or e!r}")
    finally:
        shutil.rmtree(target, ignore_errors=True)
    if not all(torch.equal(state[k], back[k]) for k in state):
        return False, f"{directory}: the state loaded back differs from the one saved"
    return True, f"{size / MiB:.1f} MiB saved and loaded through DCP in {directory}"
