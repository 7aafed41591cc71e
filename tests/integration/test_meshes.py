"""A process that held an earlier world (a round it survived) trains the next one as a fresh
process would, though its rank changed within a mesh of the same shape: DTensor's caches
still hold the earlier world's meshes, and lazarus.trainer.meshes makes them this world's."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from tests.forkedranks import run_ranks


@pytest.mark.parametrize("how", ["adopt", "drop", "frozen"])
def test_a_survivor_whose_rank_changed_trains_as_a_fresh_rank(tmp_path, how):
    """adopt: the built-in trainer re-points the old meshes; drop: a script's run(main)
    empties the caches instead (its meshes are its own); frozen: the first round's meshes
    are frozen out of the collector's sight as the zygote's are before a fork
    (meshes.freeze), and a third round, back at the first rank, must still find them."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(f"{__name__}:_two_rounds", 2, tmp_path / "ranks", store.port, str(out), how,
              env={"OMP_NUM_THREADS": "1"})
    got = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    # each process is rank 0 in one round and rank 1 in the other: every rank's shard, loss
    # and coordinate are the same in both rounds, as in a fresh process
    assert len(got) == (6 if how == "frozen" else 4)
    for name, later in got.items():
        rank = later["rank"]
        first = got[f"p{rank}-r0"]  # the fresh process that was this rank first
        assert first["rank"] == rank
        assert later["coordinates"] == [[rank]] * len(later["coordinates"]), name
        assert later["shards"] == first["shards"], name
        assert later["loss"] == first["loss"], name


def _two_rounds(me: int, port: int, out: str, how: str) -> None:
    import hashlib
    from pathlib import Path

    import torch

    from lazarus.core.trainconfig import ParallelConfig
    from lazarus.trainer import inplace, meshes
    from lazarus.trainer.models import get_model_config
    from lazarus.trainer.optim import build_optimizer
    from lazarus.trainer.parallelize import build_mesh, build_model
    from lazarus.trainer.train import train_step

    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False)
    par = ParallelConfig(dp=2, tp=1)
    for round_, rank in enumerate((me, 1 - me, me) if how == "frozen" else (me, 1 - me)):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"round/{round_}", store),
                                rank=rank, world_size=2)
        mesh = build_mesh("cpu", dp=2, tp=1)
        if how != "drop":
            meshes.adopt(mesh)  # as lazarus.trainer.train does
        model = build_model(get_model_config("tiny"), mesh, par, seed=3)
        optimizer = build_optimizer(model, lr=1e-3)
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
        loss, _norm, _applied = train_step(model, optimizer, [(tokens, tokens)],
                                           device=torch.device("cpu"), grad_clip=1.0,
                                           loss_group=mesh["dp"].get_group())
        params = list(model.parameters())
        Path(out, f"p{me}-r{round_}.json").write_text(json.dumps({
            "rank": rank, "loss": loss,
            "coordinates": [list(p.device_mesh.get_coordinate()) for p in params],
            "shards": [hashlib.sha256(p.to_local().detach().numpy().tobytes()).hexdigest()
                       for p in params]}))
        del model, optimizer, params
        # what a survivor does between its rounds
        assert inplace.release_groups()
        meshes.collect("round")
        if how == "frozen" and round_ == 0:
            meshes.freeze()  # as the zygote does before it forks a rank
        if how == "drop":
            meshes.drop_caches()  # as lazarus.trainer.run does when the rank changes
