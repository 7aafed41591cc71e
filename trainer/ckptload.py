"""Loading a committed checkpoint into a model and its optimizer, whatever (dp, tp) mesh it
was saved from: verified first (trainer/ckptverify.py), its optimizer state checked against
the model, then read through the restricted reader (trainer/dcpread.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lazarus.core.contract import CORRUPT, UNREADABLE
from lazarus.core.errors import CheckpointError, RestoreFailed
from lazarus.trainer import optimstate
from lazarus.trainer.ckptfiles import rng_file
from lazarus.trainer.ckptlist import is_whole
from lazarus.trainer.ckptverify import verify_checkpoint, verify_collectively
from lazarus.trainer.dcpread import load_tensors, read_dcp_metadata
from lazarus.trainer.rngstate import reseed_value, set_rng_state


def load_checkpoint(path: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict:
    """Load a committed checkpoint into `model` and `optimizer` (collective: every rank),
    whatever (dp, tp) mesh it was saved from; returns its `extra`.

    The manifest and every file's checksum are verified first (RestoreFailed naming the
    problem, with this rank's own finding: missing, unreadable, corrupt). RNG states are
    restored when the world size is the one that saved; otherwise each rank reseeds from
    reseed_value(step, rank).
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    manifest = verify_collectively(path) if distributed else verify_checkpoint(path)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    # Every rank reads the same .metadata against the same model, so all refuse alike.
    try:
        saved = optimstate.from_dcp_metadata(read_dcp_metadata(path))
        if problem := optimstate.optim_state_problem(model, saved, local=False):
            problem = f"checkpoint {path}: {problem}"
        else:
            # The state is read over, so allocated rather than made by a step
            # (trainer/optimstate.py); a size no memory holds is the checkpoint's fault.
            optimstate.allocate(model, optimizer, saved, local=False)
    except CheckpointError as e:
        problem = str(e)
    except (AttributeError, TypeError, RuntimeError) as e:
        problem = (f"checkpoint {path}: its DCP metadata is malformed ({type(e).__name__}: "
                   f"{str(e)[:120]})")
    if problem:
        raise RestoreFailed(problem, kind=CORRUPT, own=problem)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    load_tensors(path, state, no_dist=not distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    # The manifest is checked for what listing needs (read_manifest); what only a restore
    # reads is checked here. A KeyError would be a crash, retried on the same checkpoint,
    # where a bad checkpoint is condemned and the restore falls back.
    try:
        saved_world, extra = manifest["world_size"], manifest["extra"]
        if not isinstance(extra, dict):
            raise TypeError("extra is not an object")
        if not is_whole(saved_world):
            raise TypeError("world_size is not a number")
        step = int(manifest["step"])
        if saved_world == world:
            set_rng_state(json.loads((path / rng_file(rank)).read_text()))
        else:
            torch.manual_seed(reseed_value(step, rank))  # seeds CUDA generators too
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        problem = (f"checkpoint {path}: its manifest or RNG state is malformed "
                   f"({type(e).__name__}: {str(e)[:80]})")
        raise RestoreFailed(problem, kind=CORRUPT, own=problem) from None
    except OSError as e:
        problem = f"checkpoint {path}: {rng_file(rank)} cannot be read ({e.strerror or e})"
        raise RestoreFailed(problem, kind=UNREADABLE, own=problem) from None
    return extra
