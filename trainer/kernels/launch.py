"""How the kernels launch in this process: compiled or interpreted, with how many warps, on
which tensors. Every kernel module imports this one before it defines its kernels."""

import torch
import triton
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe(x_ptr):
    pass


# triton chooses the interpreter or the compiler when a kernel is defined, from TRITON_INTERPRET
# as it is then. The kernel modules import this module first, so the probe was defined under the
# same setting as every kernel.
INTERPRETED = isinstance(_probe, InterpretedFunction)


def entry(fn):
    """A kernel's public entry point. torch.compile traces a compiled kernel as a user-defined
    triton kernel, but fails inside triton's interpreter on an interpreted one (`KeyError:
    torch.uint64` in create_addptr, `lazarus train --compile --fused-kernels` on CPU): there it
    calls the entry point eagerly, one graph break each."""
    return torch.compiler.disable(fn) if INTERPRETED else fn


def num_warps(block: int) -> int:
    """Warps for a program that works on `block` elements at a time: about 8 elements a thread."""
    return min(max(block // 256, 1), 16)


def ready(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor whose data is there, to hand to a kernel inside an autograd Function.

    Under tensor parallelism a local shard can be an AsyncCollectiveTensor, the output of a
    collective still in flight: triton cannot read its storage until it is waited on.
    """
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t
