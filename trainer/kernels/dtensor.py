"""Fused kernels on tensor-parallel DTensors: they run on the local shard where the op is local.

Only the rules the kernels share live here; each op says which placements it accepts.
"""

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lazarus.core.errors import UserError


def reject_sharded(op: str, t: DTensor, dims: tuple[int, ...]) -> None:
    """UserError if `t` is split along any of `dims` (negative dims count from the end) or is a
    pending sum (Partial): the kernel needs those dims whole on every rank."""
    wanted = {d % t.ndim for d in dims}
    for p in t.placements:
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim % t.ndim in wanted):
            raise UserError(
                f"fused {op} cannot run on a DTensor placed {t.placements}: it needs dims "
                f"{sorted(wanted)} whole and no Partial placement (redistribute first or turn "
                "fused kernels off)"
            )


def replicated_weight(weight: torch.Tensor, x: DTensor) -> torch.Tensor:
    """The local tensor of a weight that multiplies every row of `x`, with a backward that sums
    the weight's gradient over the ranks holding different rows of `x`.

    Where `x` is sharded (say on the sequence dim) each rank's weight gradient covers only its
    rows: the gradient is the sum over that mesh dim, so it is all-reduced back to a Replicate.
    """
    # A plain weight would get each rank's share of the gradient only, silently.
    if not (isinstance(weight, DTensor) and weight.device_mesh == x.device_mesh
            and all(isinstance(p, Replicate) for p in weight.placements)):
        placed = weight.placements if isinstance(weight, DTensor) else "a plain tensor"
        raise UserError(f"a fused kernel on a DTensor needs its weight Replicate on the same mesh, "
                        f"got {placed}")
    return _ReplicatedWeight.apply(weight, x.placements)


class _ReplicatedWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: DTensor, x_placements):
        ctx.mesh = weight.device_mesh
        ctx.weight_placements = weight.placements
        ctx.grad_placements = tuple(Partial() if isinstance(p, Shard) else Replicate()
                                    for p in x_placements)
        local = weight.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        partial = DTensor.from_local(grad, ctx.mesh, ctx.grad_placements, run_check=False)
        return partial.redistribute(ctx.mesh, ctx.weight_placements), None


def like(local: torch.Tensor, x: DTensor) -> DTensor:
    """`local` (computed from x's local shard, same shape) as a DTensor placed like `x`."""
    stride = torch.empty(x.shape, device="meta").stride()  # the kernels write contiguous outputs
    return DTensor.from_local(local, x.device_mesh, x.placements, shape=x.shape, stride=stride,
                              run_check=False)
