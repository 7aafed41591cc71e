"""How far a rank's collectives have got, as the hang detector must see it.

A process group's sequence number counts the collectives the rank has *issued*. gloo blocks
until a collective is done, so on CPUs issued is done. NCCL only enqueues: the host runs
ahead of its GPU by up to a whole step, so a rank whose GPU stalls still issues the step's
collectives and looks level with its peers, and no culprit is named. On CUDA the count
reported is therefore the issued count as of the newest CUDA event, recorded on the rank's
stream after issuing, that the device has passed.

The stream waits on each collective's result before it computes with it (and on NCCL's
streams at the step's end), so an event there is passed only once the collectives issued
before it have finished on this rank's GPU.
"""

from __future__ import annotations

import os
from collections import deque

import torch
import torch.distributed as dist

# Events outstanding at most: more means the device is that far behind, and dropping the
# oldest only makes the count lag (it never runs ahead of the device).
MAX_PENDING = 256


def uses_nccl() -> bool:
    """Whether this process's default process group is NCCL's."""
    try:
        return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()
    except (RuntimeError, ValueError):
        return False


def collective_device() -> torch.device:
    """The device the default group's collectives take tensors on: NCCL takes no CPU ones."""
    if uses_nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def issued(groups) -> int:
    return sum(g._get_sequence_number_for_group() for g in groups)


class Completed:
    """`count(issued)` -> the collectives passed on the device (see module doc).

    `device`: the rank's CUDA device, or None (CPU: issued is completed). Callable from a
    thread other than the one issuing the work: events are recorded on `device`'s current
    stream, which a thread that never set a stream shares with the training thread (the
    default stream)."""

    def __init__(self, device: torch.device | None):
        self.device = device if device is not None and device.type == "cuda" else None
        self._pending: deque[tuple[torch.cuda.Event, int]] = deque()
        self._done = 0

    def count(self, issued_now: int) -> int:
        if self.device is None:
            return issued_now
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record()
        self._pending.append((event, issued_now))
        while self._pending and self._pending[0][0].query():
            self._done = max(self._done, self._pending.popleft()[1])
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
        return self._done


def script_device() -> torch.device | None:
    """A script's CUDA device, seen from a thread beside it: None unless it already uses CUDA
    (asking would make a context), else its LOCAL_RANK's, as torchrun scripts choose."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return torch.device("cuda", local % max(1, torch.cuda.device_count()))
