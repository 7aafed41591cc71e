"""FSDP2 + tensor parallelism on real gloo processes: the sharded model trains, computes what a
plain single-process model computes, and initialises its TP shards from distinct streams.

Each rank is forked from a server that imported torch once (tests/forkedranks.py); the
test process hosts the store.
"""

import pytest
import torch
import torch.distributed as dist

from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import build_optimizer
from tests.forkedranks import run_ranks as run_forked

SEED, LR, SEQ, GLOBAL_BATCH, STEPS = 3, 3e-3, 32, 8, 12


def run_ranks(tmp_path, *, dp: int, tp: int) -> dict:
    """Train STEPS steps of the tiny model on a dp x tp mesh; rank 0's record of the run."""
    ensure_corpus()  # build once here rather than racing in every rank
    world = dp * tp
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / f"dp{dp}tp{tp}.pt"
    run_forked(f"{__name__}:_rank_main", world, tmp_path / f"ranks-dp{dp}tp{tp}", world,
               store.port, dp, tp, str(out), env={"OMP_NUM_THREADS": "1"})
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def dp2tp2(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("dp2tp2"), dp=2, tp=2)


def test_loss_falls_on_one_process(tmp_path):
    losses = run_ranks(tmp_path, dp=1, tp=1)["losses"]
    assert losses[-1] < losses[0] - 1.0, losses


def test_loss_falls_on_dp2_tp2(dp2tp2):
    losses = dp2tp2["losses"]
    assert losses[-1] < losses[0] - 1.0, losses


def test_dp2_tp2_matches_a_single_process_reference(dp2tp2):
    # The plain model starts from the sharded run's initial weights and sees the same global
    # batches, as one micro-batch, with plain clip_grad_norm_.
    model = Transformer(get_model_config("tiny"))
    model.init_weights(0)  # rope tables
    model.load_state_dict(dp2tp2["init"])
    optimizer = build_optimizer(model, lr=LR)
    loader = SequenceLoader(TokenDataset(ensure_corpus(), SEQ), seed=SEED, global_batch=GLOBAL_BATCH,
                            dp_rank=0, dp_size=1, micro_batch=GLOBAL_BATCH)
    for step in range(5):
        [(inputs, targets)] = loader.next_step()
        loss = model.loss(model(inputs), targets)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert loss.item() == pytest.approx(dp2tp2["losses"][step], abs=1e-4), step
        assert grad_norm.item() == pytest.approx(dp2tp2["grad_norms"][step], rel=1e-4), step


def test_tp_shards_are_initialised_from_different_streams(dp2tp2):
    # With one seed for every TP rank, each rank's shard would be the same numbers and the two
    # halves of every split weight identical (the SmolLM3 bug).
    init = dp2tp2["init"]
    splits = {"layers.0.attention.wq.weight": 0, "layers.1.attention.wk.weight": 0,
              "layers.0.feed_forward.w1.weight": 0, "layers.0.feed_forward.w2.weight": 1,
              "layers.1.attention.wo.weight": 1, "tok_embeddings.weight": 0, "output.weight": 0}
    for name, dim in splits.items():
        first, second = init[name].chunk(2, dim=dim)
        assert not torch.allclose(first, second), name
        # Same distribution, different draws: like halves of one weight, not copies.
        assert first.std().item() == pytest.approx(second.std().item(), rel=0.2), name
    # Tp ranks see their own shard: the local shards the two ranks of a dp group held differ.
    shard0, shard1 = dp2tp2["local_wq"]
    assert shard0.shape == shard1.shape and not torch.equal(shard0, shard1)


# ---- one rank ----

def _rank_main(rank: int, world: int, port: int, dp: int, tp: int, out: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    from lazarus.trainer.parallelize import ParallelConfig, build_mesh, build_model
    from lazarus.trainer.train import train_step

    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = build_mesh("cpu", dp=dp, tp=tp)
    model = build_model(get_model_config("tiny"), mesh, ParallelConfig(dp=dp, tp=tp), seed=SEED)
    init = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}
    # This rank's TP shard of wq: its dp pieces gathered, the tp split kept. Ranks 0 and 1
    # are tp ranks 0 and 1 of the first dp group.
    wq = model.layers[0].attention.wq.weight
    local_wq = wq.redistribute(wq.device_mesh, [Replicate(), wq.placements[-1]]).to_local()
    gathered = [None] * world
    dist.all_gather_object(gathered, local_wq)
    optimizer = build_optimizer(model, lr=LR)
    loader = SequenceLoader(TokenDataset(ensure_corpus(), SEQ), seed=SEED, global_batch=GLOBAL_BATCH,
                            dp_rank=mesh["dp"].get_local_rank(), dp_size=dp, micro_batch=2)
    losses, grad_norms = [], []
    for _ in range(STEPS):
        loss, grad_norm, applied = train_step(model, optimizer, loader.next_step(), device=torch.device("cpu"),
                                              grad_clip=1.0, loss_group=mesh["dp"].get_group())
        assert applied
        losses.append(loss)
        grad_norms.append(grad_norm)
    if rank == 0:
        torch.save({"init": init, "losses": losses, "grad_norms": grad_norms,
                    "local_wq": gathered[:2]}, out)
    dist.destroy_process_group()

