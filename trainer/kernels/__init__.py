"""Fused Triton kernels for the Llama block: RMSNorm, SwiGLU, RoPE and cross-entropy.

Each op is a torch.autograd.Function with Triton forward and backward kernels; the eager
PyTorch functions of lazarus.trainer.models.llama are their reference. They run compiled on
CUDA tensors, or on CPU tensors under the triton interpreter when TRITON_INTERPRET=1 was set
before the kernels were first used (triton reads it when a kernel is defined). `available()`
says which, or why neither; each op raises UserError when it cannot run on its inputs.

Conventions (all math in fp32; outputs in the input dtype, except the loss which is fp32):
    rms_norm(x [..., N], weight [N], eps)   x * rsqrt(mean(x^2, -1) + eps) * weight
    swiglu(gate, up)                        silu(gate) * up, same shapes
    apply_rope(x [B, T, H, D], cos, sin)    rotate-half RoPE; cos/sin [T, D/2] or [T, D] (the
                                            D/2 table twice); cos and sin get no gradient
    cross_entropy(logits [..., V], targets [...])   mean NLL over tokens, -100 ignored

Tensor parallel (DTensor inputs): an op runs on the local shard where it is local, and returns a
DTensor placed like its input --
    rms_norm      x sharded on any dim but the last (e.g. sequence parallel), weight Replicate
                  (its gradient is summed over the ranks that hold different rows)
    swiglu        gate and up placed alike, any Shard (e.g. the hidden dim under colwise TP)
    apply_rope    x sharded on batch or heads; not on the sequence or head dim
    cross_entropy fully Replicate logits only (vocab-parallel loss is not supported)
Partial placements are rejected; anything unsupported raises UserError. Under the
sequence-parallel plan of lazarus.trainer.parallelize (FSDP2 on top) the norms' weights arrive
Replicate on x's mesh. A local shard that a collective is still filling (DTensor.to_local() can
return an AsyncCollectiveTensor) is waited on before a kernel reads it.
"""

import torch

from lazarus.trainer.kernels.runtime import available, require

__all__ = ["available", "rms_norm", "swiglu", "apply_rope", "cross_entropy"]

# The kernel modules are imported on first use: triton is an optional dependency, and
# TRITON_INTERPRET takes effect only if set before they are defined.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    require("rms_norm", x, weight)
    from lazarus.trainer.kernels import norm  # on first use: triton is optional

    return norm.rms_norm(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    require("swiglu", gate, up)
    from lazarus.trainer.kernels import activation  # on first use: triton is optional

    return activation.swiglu(gate, up)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    require("apply_rope", x, cos, sin)
    from lazarus.trainer.kernels import rotary  # on first use: triton is optional

    return rotary.apply_rope(x, cos, sin)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    require("cross_entropy", logits, targets)
    from lazarus.trainer.kernels import loss  # on first use: triton is optional

    return loss.cross_entropy(logits, targets)
