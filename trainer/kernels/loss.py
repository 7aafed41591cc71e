"""Fused cross-entropy: log-softmax + NLL over the last dim, mean over tokens, fp32 result.

Matches F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1)): targets equal to
-100 are ignored and left out of the mean. The [N, V] log-probabilities are never materialized:
the forward keeps one log-sum-exp per row and the backward rebuilds softmax from it.
"""

import torch
import triton
import triton.language as tl

from lazarus.trainer.kernels import dtensor, launch

IGNORE_INDEX = -100


@triton.jit
def cross_entropy_fwd_kernel(
    logits_ptr, targets_ptr, loss_ptr, lse_ptr, n_cols, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * n_cols
    # Online log-sum-exp over column blocks: rescale the running sum whenever the max grows,
    # so exp never sees a positive argument.
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    target_logit = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))


@triton.jit
def cross_entropy_bwd_kernel(
    logits_ptr, targets_ptr, lse_ptr, scale_ptr, dlogits_ptr, n_cols, ignore_index,
    BLOCK: tl.constexpr,
):
    # d(mean loss)/d logits = (softmax - onehot(target)) * dloss / n_valid, zero on ignored rows
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    target = tl.load(targets_ptr + row)
    scale = tl.where(target != ignore_index, tl.load(scale_ptr), 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(logits_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        dlogits = (grad * scale).to(dlogits_ptr.dtype.element_ty)
        tl.store(dlogits_ptr + row * n_cols + cols, dlogits, mask=mask)


def _block(n_cols: int) -> int:
    return min(triton.next_power_of_2(n_cols), 4096)


class CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, targets = launch.ready(logits), launch.ready(targets)
        n_cols = logits.shape[-1]
        logits2d = logits.reshape(-1, n_cols).contiguous()
        targets1d = targets.reshape(-1).contiguous()
        n_rows = logits2d.shape[0]
        row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        if n_rows:
            cross_entropy_fwd_kernel[(n_rows,)](
                logits2d, targets1d, row_loss, lse, n_cols, IGNORE_INDEX,
                BLOCK=_block(n_cols), num_warps=launch.num_warps(_block(n_cols)),
            )
        # stays on the device: no host sync for the count
        n_valid = (targets1d != IGNORE_INDEX).sum().to(torch.float32)
        ctx.save_for_backward(logits2d, targets1d, lse, n_valid)
        ctx.logits_shape = logits.shape
        return row_loss.sum() / n_valid

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        logits2d, targets1d, lse, n_valid = ctx.saved_tensors
        n_rows, n_cols = logits2d.shape
        scale = (launch.ready(dloss).to(torch.float32) / n_valid).reshape(1)
        dlogits = torch.empty_like(logits2d)
        if n_rows:
            cross_entropy_bwd_kernel[(n_rows,)](
                logits2d, targets1d, lse, scale, dlogits, n_cols, IGNORE_INDEX,
                BLOCK=_block(n_cols), num_warps=launch.num_warps(_block(n_cols)),
            )
        return dlogits.view(ctx.logits_shape), None


@launch.entry
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} need targets of shape {tuple(logits.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    if isinstance(logits, dtensor.DTensor):
        # Only a fully replicated DTensor: every rank then holds all tokens and the whole vocab,
        # computes the same mean, and the gradient stays Replicate. Logits split on the vocab
        # (the TP plan's) go to torch's loss parallelism instead (Transformer.loss).
        dtensor.reject_sharded("cross_entropy", logits, tuple(range(logits.ndim)))
        logits = logits.to_local()
    if isinstance(targets, dtensor.DTensor):
        dtensor.reject_sharded("cross_entropy", targets, tuple(range(targets.ndim)))
        targets = targets.to_local()
    return CrossEntropy.apply(logits, targets)
