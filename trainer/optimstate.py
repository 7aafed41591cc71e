"""A restored optimizer's state, allocated in the shape the saved state has.

`get_state_dict` (torch.distributed.checkpoint.state_dict) makes an optimizer's state, when it
has none yet, by running one whole step over zero gradients: every shard read and written
three times, and its moments allocated with page faults. A restarted rank then overwrites all
of it. Measured here for the small model: 0.7 s alone, 4-5 s with two ranks restoring on two
cores -- most of a tier-0 restore. Allocating the entries the checkpoint or snapshot holds,
and letting the restore fill them, skips that step; anything that does not map onto the
optimizer's parameters one to one leaves the optimizer as it was (DCP then makes the state
its own way). `optim_state_problem` checks the saved shapes against the model first, for a
checkpoint and a tier-0 snapshot alike.
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


# Per-parameter state that torch's optimizers (Adam, AdamW, SGD) keep in the parameter's
# shape. A restore allocates the saved shapes as they are (allocate, above), so a wrong one
# would pass the restore and fail the first step: a crash, retried on the same checkpoint,
# instead of a bad checkpoint the restore falls back from.
PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def optim_state_problem(model: torch.nn.Module, saved: dict, *, local: bool) -> str | None:
    """What in `saved` (parameter name -> {key: SavedTensor or value}) cannot be `model`'s
    optimizer state: a per-parameter entry not of its parameter's shape (its local shard's
    with `local`, else its global one) or not floating point, a step that is not a scalar.
    None when nothing; a name the model lacks is left to the load to name."""
    params = dict(model.named_parameters())
    for name, entries in saved.items():
        param = params.get(name)
        if param is None:
            continue
        own = tuple((param.to_local() if local and isinstance(param, DTensor) else param).shape)
        for key, value in entries.items():
            if not isinstance(value, SavedTensor):
                continue
            want = own if key in PARAM_SHAPED else () if key == "step" else None
            if want is not None and tuple(value.shape) != want:
                return (f"optimizer state {key} of {name} is {tuple(value.shape)}, not {want} "
                        f"(the parameter is {own})")
            if key in PARAM_SHAPED and not value.dtype.is_floating_point:
                return f"optimizer state {key} of {name} is {value.dtype}, not floating point"
    return None
