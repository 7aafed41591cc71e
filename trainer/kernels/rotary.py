"""Fused rotary position embedding, rotate-half convention, on x [B, T, H, D].

For each position t and pair (i, i + D/2), with c = cos[t, i] and s = sin[t, i]:
    out[i]       = x[i] * c - x[i + D/2] * s
    out[i + D/2] = x[i + D/2] * c + x[i] * s
cos/sin are [T, D/2], or [T, D] holding the same table twice (cat((f, f), -1)); only their first
D/2 columns are read. Math in fp32, output in x's dtype; cos and sin get no gradient.
"""

import torch
import triton
import triton.language as tl

from lazarus.trainer.kernels import dtensor, launch

ROWS = 16


@triton.jit
def rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, seq_len, n_heads, half, table_stride,
    INVERSE: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr,
):
    # A row is one (b, t, h) head vector of D = 2 * half; its position is t = (row // H) % T.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = (rows < n_rows) & (cols < half)
    t = (rows // n_heads) % seq_len
    c = tl.load(cos_ptr + t * table_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * table_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        # the rotation is orthogonal: its backward is the rotation by -angle
        s = -s
    base = rows * (2 * half) + cols
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + base, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + half, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    x = launch.ready(x).contiguous()
    out = torch.empty_like(x)
    _, seq_len, n_heads, dim = x.shape
    n_rows = x.numel() // dim
    if n_rows:
        rope_kernel[(triton.cdiv(n_rows, ROWS),)](
            x, cos, sin, out, n_rows, seq_len, n_heads, dim // 2, cos.stride(0),
            INVERSE=inverse, ROWS=ROWS, HALF=triton.next_power_of_2(dim // 2),
        )
    return out


class RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(dout, cos, sin, inverse=True), None, None


@launch.entry
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: x must be [B, T, H, D] with D even, got {tuple(x.shape)}")
    seq_len, dim = x.shape[1], x.shape[-1]
    if cos.shape != sin.shape or cos.shape not in ((seq_len, dim // 2), (seq_len, dim)):
        raise ValueError(
            f"apply_rope: cos/sin must be [T, D/2] or [T, D] = [{seq_len}, {dim // 2} or {dim}], "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    cos, sin = cos.contiguous(), sin.contiguous()
    if isinstance(x, dtensor.DTensor):
        # Heads split across TP ranks (Shard(2)) or batch split are local; a split sequence would
        # need this rank's slice of the table, and a split head dim breaks the (i, i + D/2) pairs.
        dtensor.reject_sharded("apply_rope", x, (1, 3))
        return dtensor.like(RoPE.apply(x.to_local(), cos, sin), x)
    return RoPE.apply(x, cos, sin)
