"""Fused RMSNorm: y = x / sqrt(mean(x^2, last dim) + eps) * weight, in fp32, cast to x's dtype."""

import torch
import triton
import triton.language as tl

from lazarus.trainer.kernels import dtensor, launch


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program,
    BLOCK: tl.constexpr,
):
    # Each program walks a run of rows and keeps its share of dweight in registers; the shares
    # are summed afterwards, so no atomics and a deterministic result.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, n_rows)
    for row in range(start, end):
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        wdy = w * dy
        # d/dx of x * rstd(x): the direct term minus the projection onto xhat through rstd
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / n_cols)) * rstd
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)


def _programs(device: torch.device) -> int:
    # enough programs to fill the GPU a few times over, few enough that the dweight shares
    # (one row of N floats each) stay cheap to sum
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x, weight = launch.ready(x), launch.ready(weight)
        n_cols = x.shape[-1]
        x2d = x.reshape(-1, n_cols).contiguous()
        w = weight.contiguous()
        y = torch.empty_like(x2d)
        rstd = torch.empty(x2d.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n_cols)
        if x2d.shape[0]:
            rms_norm_fwd_kernel[(x2d.shape[0],)](
                x2d, w, y, rstd, n_cols, eps, BLOCK=block, num_warps=launch.num_warps(block)
            )
        ctx.save_for_backward(x2d, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, w, rstd = ctx.saved_tensors
        n_rows, n_cols = x2d.shape
        dy2d = launch.ready(dy).reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(x2d)
        programs = max(1, min(n_rows, _programs(x2d.device)))
        rows_per_program = triton.cdiv(n_rows, programs)
        dw_partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x2d.device)
        block = triton.next_power_of_2(n_cols)
        if n_rows:
            rms_norm_bwd_kernel[(programs,)](
                dy2d, x2d, w, rstd, dx, dw_partial, n_rows, n_cols, rows_per_program,
                BLOCK=block, num_warps=launch.num_warps(block),
            )
        return dx.view(dy.shape), dw_partial.sum(0).to(w.dtype), None


@launch.entry
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")
    if isinstance(x, dtensor.DTensor):
        dtensor.reject_sharded("rms_norm", x, (-1,))
        w_local = dtensor.replicated_weight(weight, x)
        return dtensor.like(RMSNorm.apply(x.to_local(), w_local, eps), x)
    return RMSNorm.apply(x, weight, eps)
