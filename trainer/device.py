"""Which device this process trains on: CUDA where there is one, unless LAZARUS_DEVICE says.

LAZARUS_DEVICE=cpu keeps a process on the CPU (gloo) on a machine with GPUs: the CPU test
suite sets it, so that it tests the same thing on a GPU box as elsewhere (its multi-rank tests
put several ranks on one machine, more than it may have GPUs). =cuda insists on CUDA.
"""

from __future__ import annotations

import os

import torch

from lazarus.core.contract import DEVICE_ENV
from lazarus.core.errors import UserError


def device_type() -> str:
    wanted = os.environ.get(DEVICE_ENV, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise UserError(f"{DEVICE_ENV}={wanted!r}: must be cpu or cuda")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{DEVICE_ENV}=cuda but torch sees no CUDA device here")
    if wanted:
        return wanted
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def local_cuda_device(local_rank: int) -> int:
    """The GPU of local rank `local_rank`: one GPU per rank, as NCCL needs (two ranks of one
    communicator on one GPU fail at its creation)."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(f"local rank {local_rank} has no GPU of its own: this machine has "
                        f"{count}; run at most {count} ranks per node (--nproc)")
    return local_rank
