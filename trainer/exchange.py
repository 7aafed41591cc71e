"""Small values exchanged between ranks as JSON, never as pickles.

torch's all_gather_object, gather_object and broadcast_object_list unpickle what the other
ranks send: one rank running someone's code (a compromised node, a tampered job) would run it
on every rank. Here a value travels as its JSON text in a uint8 tensor, preceded by its length
(every rank learns every length first, so all pad to the longest), and is read back with
json.loads: whatever a peer sends, the worst it makes is a ValueError. Values must be JSON's:
a tuple comes back a list, a dict's keys strings.

Collective like torch's: every rank of `group` calls the same function at the same point. On an
NCCL group the bytes go through this rank's current CUDA device.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

# Far above anything exchanged (a checkpoint's file list: ~100 bytes a file); a length over it
# is refused before memory is set aside for every rank's copy of it.
MAX_BYTES = 64 << 20


class ExchangeError(ValueError):
    """A peer sent something that is not a value: too long, not UTF-8 or not JSON."""


def _device(group) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(value: Any, device: torch.device) -> torch.Tensor:
    data = bytearray(json.dumps(value, separators=(",", ":")).encode())
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def _decode(data: torch.Tensor, length: int, sender: int) -> Any:
    try:
        return json.loads(bytes(data[:length].cpu().numpy()).decode())
    except (ValueError, RecursionError) as e:
        raise ExchangeError(f"rank {sender} of the group sent something that is not JSON "
                            f"({str(e)[:80]})") from None


def _check(length: int, sender: int) -> int:
    if not 0 < length <= MAX_BYTES:
        raise ExchangeError(f"rank {sender} of the group sent a length of {length} bytes (a "
                            f"value is 1 to {MAX_BYTES})")
    return length


def _padded(value: Any, group) -> tuple[torch.Tensor, list[int]]:
    """This rank's value padded to the longest of the group's, and every rank's length."""
    device = _device(group)
    mine = _encode(value, device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device)
             for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.long, device=device),
                    group=group)
    lengths = [_check(int(s.item()), rank) for rank, s in enumerate(sizes)]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine
    return padded, lengths


def all_gather(value: Any, group=None) -> list:
    """Every rank's `value`, in the group's rank order."""
    padded, lengths = _padded(value, group)
    out = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(out, padded, group=group)
    return [_decode(data, n, rank) for rank, (data, n) in enumerate(zip(out, lengths))]


def gather(value: Any, dst: int, group=None) -> list | None:
    """Every rank's `value` on the rank whose global rank is `dst`, in the group's rank order;
    None on the others."""
    padded, lengths = _padded(value, group)
    here = dist.get_rank() == dst
    out = [torch.empty_like(padded) for _ in lengths] if here else None
    dist.gather(padded, out, dst=dst, group=group)
    if not here:
        return None
    return [_decode(data, n, rank) for rank, (data, n) in enumerate(zip(out, lengths))]


def broadcast(value: Any, src: int, group=None) -> Any:
    """The `value` of the rank whose global rank is `src`, on every rank (the others' `value`
    is not looked at)."""
    device = _device(group)
    here = dist.get_rank() == src
    mine = _encode(value, device) if here else None
    size = torch.tensor([mine.numel() if here else 0], dtype=torch.long, device=device)
    dist.broadcast(size, src=src, group=group)
    length = _check(int(size.item()), src)
    data = mine if here else torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    return _decode(data, length, src)
