"""How a fixed global batch is split: micro-batch x data-parallel ranks x accumulation steps.

The global batch (sequences per optimizer step) belongs to the job and never changes; when the
number of data-parallel ranks changes, gradient accumulation absorbs it, so a resized run keeps
the same training dynamics.

On a GPU the micro-batch is also bounded by memory: `activation_bytes` estimates what one
micro-batch's activations take per GPU, counted the way Korthikanti et al. 2022 count them
("Reducing Activation Recomputation in Large Transformer Models", section 4: the bytes each
op keeps for its backward), and `plan_batches` picks the largest micro-batch that fits what
the caller says is free. The estimate is rough (the allocator, the kernels chosen and
torch.compile all move it), so it picks, and warns, but never refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazarus.core.errors import UserError
from lazarus.core.modelconfig import ModelConfig

# With no micro-batch given and no memory figure (CPU), the largest divisor of the per-rank
# batch up to this: a shrink of the data-parallel degree then adds accumulation steps, not
# activation memory.
DEFAULT_MAX_MICRO_BATCH = 8

# Bytes per logit (tokens x vocab / tp) at the loss's peak, the bf16 logits included.
# cross_entropy_ref: 14 (measured on an H200: the logits, their fp32 copy, the fp32
# log-probabilities and the gradient's fp32 temporaries); the fused kernel: 4 (the logits and
# their gradient, measured); loss parallelism under TP: 18 (counted: two more fp32
# temporaries in its backward).
LOGIT_BYTES = {"reference": 14, "fused": 4, "loss_parallel": 18}


def layer_bytes_per_token(cfg: ModelConfig, *, tp: int = 1, fused: bool = False) -> float:
    """Bytes one block keeps for its backward, per token, with 16-bit activations.

    The paper's GPT block keeps 34 x dim + 5 x heads x seq_len; here the attention scores'
    term is gone (SDPA's flash kernel keeps none) and the count is this block's, which comes
    to 34 x dim for 8b with `fused` (the Triton kernels) and 53 x dim with the eager ops,
    whose norms keep fp32 copies and whose SwiGLU keeps silu(gate) too (measured on an H200
    at 8b's proportions and dim 2048: 3-5% more).
    Sequence-parallel TP splits everything by tp except the two projections' inputs, which
    torch's SequenceParallel keeps all-gathered (Megatron's gathers them again instead).
    """
    h, f = cfg.dim, cfg.ffn_hidden
    kv = cfg.dim * cfg.n_kv_heads // cfg.n_heads
    norm = 2 * h if fused else 4 * h + 4 * h  # its input; eager: fp32 x and x * rsqrt
    gathered = 2 * h + 2 * h  # the inputs of wq/wk/wv and of w1/w3, the whole sequence
    attention = 2 * h + 2 * 2 * kv + 2 * h  # q, k and v (after RoPE), SDPA's output: wo's input
    mlp = (3 if fused else 4) * 2 * f  # gate, up, (eager: silu(gate)), w2's input
    return gathered + (2 * norm + attention + mlp) / tp


def activation_bytes(cfg: ModelConfig, *, micro_batch: int, seq_len: int, tp: int = 1,
                     checkpointing: bool = False, fused: bool = False) -> int:
    """Estimated peak bytes of one micro-batch's activations on each GPU, at the start of the
    backward: every block's saved tensors plus the logits, with tensor parallelism `tp`
    (sequence parallel between blocks, the vocabulary split). `checkpointing`: each block
    keeps only its input (16-bit, sequence-sharded) and rebuilds the rest, one block at a
    time, in the backward."""
    layer = layer_bytes_per_token(cfg, tp=tp, fused=fused)
    if checkpointing:
        per_token = cfg.n_layers * 2 * cfg.dim / tp + layer
    else:
        per_token = cfg.n_layers * layer
    loss = "loss_parallel" if tp > 1 else "fused" if fused else "reference"
    per_token += cfg.vocab_size / tp * LOGIT_BYTES[loss]
    return int(micro_batch * seq_len * per_token)


@dataclass(kw_only=True, slots=True, frozen=True)
class ActivationBudget:
    """What a micro-batch's activations may take on each GPU, and what decides their size.
    free_bytes: device memory left once the weights, gradients and optimizer state are
    allocated, less some headroom (lazarus.trainer.parallelize.activation_budget)."""
    model: ModelConfig
    seq_len: int
    tp: int = 1
    activation_checkpointing: bool = False
    fused: bool = False
    free_bytes: int

    def need(self, micro_batch: int) -> int:
        return activation_bytes(self.model, micro_batch=micro_batch, seq_len=self.seq_len,
                                tp=self.tp, checkpointing=self.activation_checkpointing,
                                fused=self.fused)

    def fits(self, micro_batch: int) -> bool:
        return self.need(micro_batch) <= self.free_bytes


@dataclass(kw_only=True, slots=True, frozen=True)
class BatchPlan:
    global_batch: int
    dp: int
    micro_batch: int
    accumulation: int
    # Why the micro-batch may not fit the GPU's memory (the estimate says so); None when it
    # fits or no memory figure was given.
    warning: str | None = None

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accumulation


def plan_batches(global_batch: int, dp: int, micro_batch: int | None = None, *,
                 memory: ActivationBudget | None = None) -> BatchPlan:
    """Split `global_batch` over `dp` ranks. No `micro_batch`: the largest divisor of the
    per-rank batch that fits `memory`, or, without a memory figure, up to
    DEFAULT_MAX_MICRO_BATCH. A micro-batch that the estimate says does not fit is kept, with a
    warning: the estimate is rough, and the job said what it wanted."""
    if global_batch % dp:
        raise UserError(f"global batch {global_batch} is not divisible by dp={dp} data-parallel ranks")
    per_rank = global_batch // dp
    divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    if micro_batch is None:
        if memory is None:
            micro_batch = max(m for m in divisors if m <= DEFAULT_MAX_MICRO_BATCH)
        else:
            micro_batch = max((m for m in divisors if memory.fits(m)), default=1)
    elif per_rank % micro_batch:
        raise UserError(
            f"micro batch {micro_batch} does not divide the {per_rank} sequences per rank "
            f"(global batch {global_batch} / dp={dp})")
    warning = None
    if memory is not None and not memory.fits(micro_batch):
        smaller = "data.micro_batch or data.seq_len" if micro_batch > 1 else "data.seq_len"
        warning = (f"micro batch {micro_batch} needs an estimated {memory.need(micro_batch) / 2**30:.1f} "
                   f"GiB of activations per GPU where {memory.free_bytes / 2**30:.1f} GiB are free: "
                   f"it may run out of memory (lower {smaller}, raise parallelism.tp, or turn on "
                   "parallelism.activation_checkpointing)")
    return BatchPlan(global_batch=global_batch, dp=dp, micro_batch=micro_batch,
                     accumulation=per_rank // micro_batch, warning=warning)
