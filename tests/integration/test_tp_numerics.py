"""Tensor parallelism computes what the whole model computes: tp=2 gloo ranks.

Each rank holds half of the query heads and half of the key/value heads (grouped-query
attention through SDPA's enable_gqa on the rank's share), and half of the vocabulary: the
logits stay split, and the loss is computed on them under torch's loss parallelism. The
logits, the loss and every parameter's gradient must equal, within fp32 rounding, those of a
single-process model with the same weights whose loss is cross_entropy_ref on whole logits
(what the trainer computed before the vocabulary stayed split).
"""

import torch
import torch.distributed as dist

from tests.forkedranks import run_ranks

# fp32, the same math in another order (the loss's max and sum of exponentials are reduced
# over the ranks); gradients pass two layers of matmuls.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
GRAD_TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def test_split_heads_and_vocabulary_match_the_whole_model(tmp_path):
    run_ranks(f"{__name__}:_rank", 2, tmp_path, str(tmp_path / "store"), 2,
              env={"OMP_NUM_THREADS": "1"})


# ---- the ranks ----


def _compare(tp: int) -> None:
    from torch.distributed.tensor import DTensor, Shard

    from lazarus.trainer.models import Transformer, cross_entropy_ref, get_model_config
    from lazarus.trainer.parallelize import ParallelConfig, build_mesh, build_model

    cfg = get_model_config("tiny")  # 4 query heads and 2 key/value heads: 2 and 1 a rank
    mesh = build_mesh("cpu", dp=1, tp=tp)
    model = build_model(cfg, mesh, ParallelConfig(dp=1, tp=tp), seed=4)
    whole = Transformer(cfg)
    whole.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})

    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :3] = -100  # left out of the mean, as cross_entropy_ref leaves them

    logits = model(inputs)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
    assert logits.to_local().shape == (2, 16, cfg.vocab_size // tp)  # no rank holds them all
    loss = model.loss(logits, targets)
    assert not isinstance(loss, DTensor) and loss.shape == ()
    loss.backward()

    ref_logits = whole(inputs)
    ref_loss = cross_entropy_ref(ref_logits, targets)
    ref_loss.backward()

    torch.testing.assert_close(logits.full_tensor(), ref_logits, **TOLERANCE)
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), whole.get_parameter(name).grad,
                                   **GRAD_TOLERANCE, msg=lambda m: f"grad {name}: {m}")


def _rank(rank: int, store_path: str, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    _compare(world)
    dist.destroy_process_group()
