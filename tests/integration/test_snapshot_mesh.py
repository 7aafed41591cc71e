"""Tier-0 snapshots of a tensor-parallel, FSDP-sharded model on real gloo processes: each rank
restores its own shard into a freshly built model and the next steps' losses are those of the
run that never stopped, bit for bit.

Each rank is forked from a server that imported torch once (tests/forkedranks.py); the
test process hosts the store.
"""

import json

import torch
import torch.distributed as dist

from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
from lazarus.trainer.models import get_model_config
from lazarus.trainer.optim import build_optimizer
from tests.forkedranks import run_ranks

SEED, LR, SEQ, GLOBAL_BATCH = 3, 3e-3, 32, 8


def test_a_tp_sharded_rank_resumes_from_its_snapshot_bit_for_bit(tmp_path):
    ensure_corpus()
    world = 2
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "losses.json"
    run_ranks(f"{__name__}:_rank_main", world, tmp_path / "ranks", world, store.port, str(out),
              env={"OMP_NUM_THREADS": "1"})
    got = json.loads(out.read_text())
    assert len(got["uninterrupted"]) == 3
    assert got["resumed"] == got["uninterrupted"]


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    from lazarus.trainer import snapshot
    from lazarus.trainer.parallelize import ParallelConfig, build_mesh, build_model
    from lazarus.trainer.train import train_step

    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = build_mesh("cpu", dp=1, tp=2)

    def built(seed: int):
        model = build_model(get_model_config("tiny"), mesh, ParallelConfig(dp=1, tp=2), seed=seed)
        return model, build_optimizer(model, lr=LR)

    def steps(model, optimizer, loader, n: int) -> list[float]:
        return [train_step(model, optimizer, loader.next_step(), device=torch.device("cpu"),
                           grad_clip=1.0, loss_group=mesh["dp"].get_group())[0]
                for _ in range(n)]

    def loader():
        return SequenceLoader(TokenDataset(ensure_corpus(), SEQ), seed=SEED,
                              global_batch=GLOBAL_BATCH, dp_rank=0, dp_size=1, micro_batch=4)

    model, optimizer = built(SEED)
    data = loader()
    steps(model, optimizer, data, 3)
    tensors, values = snapshot.capture(model, optimizer)
    header = {"job": "j", "round": 1, "rank": rank, "world_size": world, "step": 3,
              "extra": {"loader": data.state_dict()}, "rng": snapshot.rng_state()}
    saved = snapshot.encode(tensors, values, header=header)
    uninterrupted = steps(model, optimizer, data, 3)

    fresh, fresh_opt = built(SEED + 1)  # other weights: only the snapshot can make them right
    torch.manual_seed(12345)
    extra = snapshot.restore(saved, fresh, fresh_opt, rank=rank, world_size=world)["extra"]
    data = loader()
    data.load_state_dict(extra["loader"])
    resumed = steps(fresh, fresh_opt, data, 3)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"uninterrupted": uninterrupted, "resumed": resumed}, f)
    dist.destroy_process_group()

