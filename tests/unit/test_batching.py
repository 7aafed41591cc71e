"""Splitting the fixed global batch into micro-batch x dp x accumulation."""

import pytest

from lazarus.core.errors import UserError
from lazarus.core.batching import ActivationBudget, activation_bytes, plan_batches
from lazarus.core.modelconfig import MODEL_SIZES


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


# ---- sizing the micro-batch by memory (GPUs) ----

GiB = 2**30


def budget(free_gib: float, **kw) -> ActivationBudget:
    return ActivationBudget(**{"model": MODEL_SIZES["8b"], "seq_len": 8192, "tp": 1,
                               "free_bytes": int(free_gib * GiB), **kw})


def test_activation_estimate_grows_with_the_work_and_shrinks_with_its_remedies():
    cfg = MODEL_SIZES["8b"]

    def need(**kw):
        return activation_bytes(cfg, **{"micro_batch": 2, "seq_len": 4096, **kw})

    assert need(micro_batch=1) < need() < need(micro_batch=4) == 2 * need()
    assert need(seq_len=2048) < need() < need(seq_len=8192)
    assert need(tp=8) < need(tp=2) < need()
    assert need(checkpointing=True) < need() / 3  # the logits stay
    assert need(fused=True) < need()
    assert activation_bytes(MODEL_SIZES["1b"], micro_batch=2, seq_len=4096) < need()


def test_activation_estimate_of_8b_is_in_the_known_range():
    # 8b, one sequence of 8k tokens, eager ops: 53 x dim bytes a token in each of 32 layers,
    # 53 GiB, and 14 GiB at the loss for the 128k vocabulary.
    need = activation_bytes(MODEL_SIZES["8b"], micro_batch=1, seq_len=8192)
    assert 60 * GiB < need < 75 * GiB
    assert activation_bytes(MODEL_SIZES["8b"], micro_batch=1, seq_len=8192, tp=2) < 40 * GiB
    assert activation_bytes(MODEL_SIZES["8b"], micro_batch=1, seq_len=8192, checkpointing=True) < 25 * GiB


def test_without_a_memory_figure_the_plan_is_unchanged():
    for global_batch, dp in [(8, 2), (256, 2), (14, 1), (32, 4)]:
        assert plan_batches(global_batch, dp) == plan_batches(global_batch, dp, memory=None)
        assert plan_batches(global_batch, dp).warning is None


def test_memory_picks_the_largest_fitting_divisor_of_the_rank_share():
    # tp=8, checkpointing: about 2.6 GiB per sequence of 8k tokens.
    per_sequence = budget(0, tp=8, activation_checkpointing=True).need(1)
    room = budget((5.5 * per_sequence) / GiB, tp=8, activation_checkpointing=True)
    plan = plan_batches(48, 2, memory=room)  # 24 a rank: divisors 1, 2, 3, 4, 6, ...
    assert (plan.micro_batch, plan.accumulation, plan.warning) == (4, 6, None)
    # The cap of 8 without a memory figure does not bound a GPU with room for more.
    roomy = budget(1000, tp=8, activation_checkpointing=True)
    assert plan_batches(48, 2, memory=roomy).micro_batch == 24


def test_nothing_fits_gives_one_sequence_and_a_warning():
    plan = plan_batches(16, 2, memory=budget(10))
    assert plan.micro_batch == 1 and plan.accumulation == 8
    assert "micro batch 1 needs an estimated" in plan.warning
    assert "10.0 GiB are free" in plan.warning and "data.seq_len" in plan.warning


def test_an_explicit_micro_batch_that_does_not_fit_is_kept_with_a_warning():
    plan = plan_batches(16, 2, micro_batch=4, memory=budget(80))
    assert plan.micro_batch == 4 and plan.accumulation == 2
    assert plan.warning.startswith("micro batch 4 needs an estimated")
    assert "lower data.micro_batch" in plan.warning
    assert plan_batches(16, 2, micro_batch=1, memory=budget(80, tp=8)).warning is None
