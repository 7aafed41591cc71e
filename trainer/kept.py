"""What a surviving rank keeps of its round for the next one: its model and optimizer (their
FSDP2 and DTensor objects, compiled code and device memory), and the step they hold
(docs/inplace.md, "As built" 4).

The built-in trainer holds its objects here while it trains, and marks each step once its
update (or its skip) is done. When the rank survives a lost peer (lazarus.trainer.inplace)
and its next round has the same shape -- the same job, model, mesh and rank, so the same
shard -- `take` hands the objects back and `reuse` makes them the new world's: FSDP2's
iteration state, which a failure in the middle of a forward or backward leaves half done,
is reset (`FSDPModule.reset_iter_state`), its groups re-resolved from the meshes (which
`lazarus.trainer.meshes.adopt` has already made the new world's), and the gradients
dropped. The round's restore then costs nothing when the step it restores is the one the
objects hold, and is a copy in host memory when it is the last snapshot the rank took;
otherwise it loads into them as into new ones. Any other shape drops them,
and the rank builds anew, as a fresh process would.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from dataclasses import dataclass, field

import torch

from lazarus.trainer.rankprocess import RankProcess
from lazarus.trainer.snapshot import Capture


@dataclass(eq=False)
class Held:
    """`shape`: what the objects fit (`shape_of`). `step`: the last step whose update or skip
    this rank finished (0: none yet); `extra` and `rng`: what a restore of that step sets
    besides the tensors (the trainer's `resumable()`, the RNG state). `captured`: the last
    tier-0 snapshot this rank took, as still in its host buffers (trainer.snapshot
    .Snapshotter.last): a round restoring that step loads it from there, not from its file."""
    shape: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int = 0
    extra: dict = field(default_factory=dict)
    rng: dict | None = None
    captured: Capture | None = None

    def mark(self, step: int, extra: dict, rng: dict) -> None:
        self.step, self.extra, self.rng = step, extra, rng


def shape_of(cfg, *, job_id: str, rank: int, world_size: int, device: str) -> str:
    """Everything the model and optimizer objects depend on: equal shapes, equal objects
    (a rank's shard is fixed by its coordinate, so the rank is part of it)."""
    return json.dumps({"job": job_id, "model": dataclasses.asdict(cfg.model),
                       "parallelism": dataclasses.asdict(cfg.parallelism),
                       "weight_decay": cfg.optimizer.weight_decay, "seed": cfg.seed,
                       "deterministic": cfg.deterministic, "rank": rank, "world": world_size,
                       "device": device}, sort_keys=True, default=str)


def take(process: RankProcess, shape: str, *, restoring: bool) -> Held | None:
    """The objects `process` holds for a round of `shape` that restores a step
    (`restoring`; a round from scratch initialises new ones), or None; whatever is held is
    let go either way (a mismatch frees its memory before the new round builds its own)."""
    held, process.held = process.held, None
    if held is None:
        return None
    if held.shape != shape or held.step < 1 or not restoring:
        del held
        gc.collect()  # modules and optimizers are cycles
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return None
    return held


def reuse(held: Held) -> None:
    """Make the held model and optimizer the new world's: call after this world's mesh
    adopted the old ones (lazarus.trainer.meshes.adopt), before any collective."""
    from torch.distributed.fsdp import FSDPModule

    model = held.model
    groups = [group for module in model.modules() if isinstance(module, FSDPModule)
              for group in module._get_fsdp_state()._fsdp_param_groups]
    for group in groups:
        _regroup(group)
        # The last round's collectives were aborted with their groups: waiting on one (as
        # the reset below would) raises. Their results are discarded by the reset anyway.
        group._all_gather_result = None
        for param in group.fsdp_params:
            # A step's micro-batches before the last accumulate their gradients on the
            # unsharded parameters, unreduced (gradient sync off); the reset keeps them, and
            # the next step would add them to its own.
            param.unsharded_accumulated_grad = None
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None
    if isinstance(model, FSDPModule) and model._get_fsdp_state()._is_root is not False:
        model.reset_iter_state()
    held.optimizer.zero_grad(set_to_none=True)


def _regroup(group) -> None:
    """FSDP2 keeps the process groups of its mesh when built (FSDPMeshInfo.__post_init__);
    the mesh objects are this world's now, so resolving them again gives its groups."""
    infos = {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info,
                                *(p.mesh_info for p in group.fsdp_params),
                                *(p.post_forward_mesh_info for p in group.fsdp_params))
             if i is not None}
    for info in infos.values():
        info.__post_init__()
