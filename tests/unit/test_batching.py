"""Splitting the fixed global batch into micro-batch x dp x accumulation."""

import pytest

from lazarus.core.errors import UserError
from lazarus.core.batching import plan_batches


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_resize_keeps_the_global_batch(dp):
    plan = plan_batches(32, dp, micro_batch=2)
    assert plan.micro_batch * plan.dp * plan.accumulation == 32


def test_shrinking_dp_adds_accumulation_not_micro_batch():
    assert plan_batches(32, 4, 2).accumulation == 4
    assert plan_batches(32, 2, 2).accumulation == 8


def test_default_micro_batch_is_capped():
    assert plan_batches(8, 2).micro_batch == 4 and plan_batches(8, 2).accumulation == 1
    big = plan_batches(256, 2)
    assert big.micro_batch == 8 and big.accumulation == 16
    assert plan_batches(14, 1).micro_batch == 7


def test_global_batch_not_divisible_by_dp():
    with pytest.raises(UserError, match="global batch 10 is not divisible by dp=4"):
        plan_batches(10, 4)


def test_micro_batch_not_dividing_the_rank_share():
    with pytest.raises(UserError, match="micro batch 3 does not divide the 8 sequences per rank"):
        plan_batches(16, 2, micro_batch=3)
