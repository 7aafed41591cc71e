"""A rank's RNG state as JSON (a checkpoint's rng-<rank>.json, a tier-0 snapshot's header),
and the seed a rank takes instead when the world size changed."""

from __future__ import annotations

import base64
import hashlib

import torch


def rng_state() -> dict:
    state = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    # Only a process that uses CUDA has a CUDA generator worth keeping: asking would make a
    # CUDA context in a CPU rank on a GPU machine.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().numpy().tobytes()
        state["torch_cuda"] = base64.b64encode(cuda).decode()
    return state


def set_rng_state(state: dict) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch_cpu"]))
    if torch.cuda.is_available() and torch.cuda.is_initialized() and "torch_cuda" in state:
        torch.cuda.set_rng_state(tensor(state["torch_cuda"]))


def reseed_value(step: int, rank: int) -> int:
    """The seed each rank takes when a checkpoint is loaded into a different world size.

    RNG streams cannot be split or merged across ranks, so a resized run reseeds instead:
    deterministically from (step, rank), so the same resize of the same checkpoint gives the
    same run twice.
    """
    digest = hashlib.sha256(f"lazarus-rng:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
