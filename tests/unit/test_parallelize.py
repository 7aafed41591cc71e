"""The decisions parallelize.py makes about a GPU run's memory, as pure functions."""

import pytest

from lazarus.core.trainconfig import ParallelConfig
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.parallelize import activation_budget, gradient_sync_for, sync_every_micro_batch


@pytest.mark.parametrize("device,dp,every", [
    ("cuda", 8, True),  # FSDP2 would keep all unsharded fp32 gradients between reductions
    ("cuda", 2, True),
    ("cuda", 1, False),  # nothing sharded, nothing to save
    ("cpu", 2, False),  # gloo: one reduction a step, as the CPU runs always did
    ("cpu", 1, False),
])
def test_when_every_micro_batch_reduces(device, dp, every):
    assert sync_every_micro_batch(device, dp) is every


def test_gradient_sync_for_the_micro_batches_of_a_step():
    assert [gradient_sync_for(i, 4, every=False) for i in range(4)] == [False, False, False, True]
    assert [gradient_sync_for(i, 4, every=True) for i in range(4)] == [True] * 4
    assert gradient_sync_for(0, 1, every=False)


def test_a_model_reduces_once_a_step_unless_parallelize_says_otherwise():
    assert Transformer(get_model_config("tiny")).sync_every_micro_batch is False


def test_no_activation_budget_on_cpu():
    # None keeps plan_batches's CPU plan (the cap of 8) and needs no process group.
    model = Transformer(get_model_config("tiny"))
    assert activation_budget(model, ParallelConfig(), seq_len=128) is None
