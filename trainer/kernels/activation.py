"""Fused SwiGLU: silu(gate) * up, elementwise, computed in fp32 and cast to the inputs' dtype."""

import torch
import triton
import triton.language as tl

from lazarus.core.errors import UserError
from lazarus.trainer.kernels import dtensor, launch

BLOCK = 1024


@triton.jit
def swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    # silu'(g) = sig + g * sig * (1 - sig)
    dgate = dout * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dgate_ptr + offs, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dout * g * sig).to(dup_ptr.dtype.element_ty), mask=mask)


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = launch.ready(gate).contiguous(), launch.ready(up).contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        gate, up = ctx.saved_tensors
        dout = launch.ready(dout).contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dout, dgate, dup, n, BLOCK=BLOCK)
        return dgate, dup


@launch.entry
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
        )
    if isinstance(gate, dtensor.DTensor) or isinstance(up, dtensor.DTensor):
        # Elementwise: any placement works as long as both shards hold the same elements.
        if not (isinstance(gate, dtensor.DTensor) and isinstance(up, dtensor.DTensor)) or (
            gate.placements != up.placements or gate.device_mesh != up.device_mesh
        ):
            raise UserError("fused swiglu needs gate and up both DTensors placed alike")
        dtensor.reject_sharded("swiglu", gate, ())
        return dtensor.like(SwiGLU.apply(gate.to_local(), up.to_local()), gate)
    return SwiGLU.apply(gate, up)
