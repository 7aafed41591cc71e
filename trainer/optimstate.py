"""A restored optimizer's state, allocated in the shape the saved state has.

`get_state_dict` (torch.distributed.checkpoint.state_dict) makes an optimizer's state, when it
has none yet, by running one whole step over zero gradients: every shard read and written
three times, and its moments allocated with page faults. A restarted rank then overwrites all
of it. Measured here for the small model: 0.7 s alone, 4-5 s with two ranks restoring on two
cores -- most of a tier-0 restore. Allocating the entries the checkpoint or snapshot holds,
and letting the restore fill them, skips that step; anything that does not map onto the
optimizer's parameters one to one leaves the optimizer as it was (DCP then makes the state
its own way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """The shape and dtype of one saved state entry."""
    shape: tuple[int, ...]
    dtype: torch.dtype


def allocate(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             saved: dict[str, dict[str, SavedTensor | object]], *, local: bool) -> bool:
    """Give `optimizer`, if it has no state, entries like `saved`'s: parameter name -> {state
    key: SavedTensor, or a plain value}. An entry of a parameter's shape (its local shard's
    with `local`, else its global shape) is made like the parameter (a DTensor of the same
    placement); others are plain tensors. Returns whether it allocated."""
    if optimizer.state:
        return False
    names = {param: name for name, param in model.named_parameters()}
    fresh = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            entries = saved.get(names.get(param, ""))
            if not entries:
                return False
            own = tuple((param.to_local() if local and isinstance(param, DTensor) else param).shape)
            state = {}
            for key, value in entries.items():
                if not isinstance(value, SavedTensor):
                    state[key] = value
                elif value.shape and value.shape == own and value.dtype == param.dtype:
                    state[key] = torch.empty_like(param)
                else:
                    state[key] = torch.empty(value.shape, dtype=value.dtype, device=_device(param))
            fresh[param] = state
    optimizer.state.update(fresh)
    return True


def _device(param: torch.Tensor) -> torch.device:
    return param.to_local().device if isinstance(param, DTensor) else param.device


def from_snapshot(tensors: dict[str, torch.Tensor], values: dict) -> dict:
    """`saved` for `allocate` from a tier-0 snapshot's leaves ("optim/state/<name>/<key>")."""
    out: dict[str, dict] = {}
    for path, value in (*tensors.items(), *values.items()):
        if not path.startswith("optim/state/"):
            continue
        name, _, key = path[len("optim/state/"):].rpartition("/")
        out.setdefault(name, {})[key] = (SavedTensor(tuple(value.shape), value.dtype)
                                         if isinstance(value, torch.Tensor) else value)
    return out


def from_dcp_metadata(metadata) -> dict:
    """`saved` for `allocate` from a DCP checkpoint's metadata (keys flattened with dots:
    "optim.state.<name>.<key>"); None when an entry is not a tensor (its value is not in the
    metadata: DCP makes the state then)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, dict] = {}
    for flat, meta in metadata.state_dict_metadata.items():
        if not flat.startswith("optim.state."):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            return {}
        name, _, key = flat[len("optim.state."):].rpartition(".")
        out.setdefault(name, {})[key] = SavedTensor(tuple(meta.size), meta.properties.dtype)
    return out
