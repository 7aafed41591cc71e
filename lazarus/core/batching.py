"""How a fixed global batch is split: micro-batch x data-parallel ranks x accumulation steps.

The global batch (sequences per optimizer step) belongs to the job and never changes; when the
number of data-parallel ranks changes, gradient accumulation absorbs it, so a resized run keeps
the same training dynamics.
"""

from __future__ import annotations

from dataclasses import dataclass

from lazarus.core.errors import UserError

# With no micro-batch given, the largest divisor of the per-rank batch up to this: a shrink of
# the data-parallel degree then adds accumulation steps, not activation memory.
DEFAULT_MAX_MICRO_BATCH = 8


@dataclass(kw_only=True, slots=True, frozen=True)
class BatchPlan:
    global_batch: int
    dp: int
    micro_batch: int
    accumulation: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accumulation


def plan_batches(global_batch: int, dp: int, micro_batch: int | None = None) -> BatchPlan:
    if global_batch % dp:
        raise UserError(f"global batch {global_batch} is not divisible by dp={dp} data-parallel ranks")
    per_rank = global_batch // dp
    if micro_batch is None:
        micro_batch = max(m for m in range(1, min(per_rank, DEFAULT_MAX_MICRO_BATCH) + 1) if per_rank % m == 0)
    elif per_rank % micro_batch:
        raise UserError(
            f"micro batch {micro_batch} does not divide the {per_rank} sequences per rank "
            f"(global batch {global_batch} / dp={dp})")
    return BatchPlan(global_batch=global_batch, dp=dp, micro_batch=micro_batch,
                     accumulation=per_rank // micro_batch)
