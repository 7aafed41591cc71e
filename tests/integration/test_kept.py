"""Survivors go on in the model and optimizer objects they had (lazarus.trainer.kept): two gloo
ranks train with two micro-batches a step (gradients reduced after the last, as on CPU), one
fails in the middle of the second micro-batch's forward (FSDP2 has gathered some layers and
holds the first micro-batch's unreduced gradients), both abort their groups, and the next world -- new process groups under a new
store prefix -- trains on in the same objects. Its losses are the uninterrupted run's, bit
for bit: FSDP2's half-done iteration was reset and its groups re-resolved (had it kept the
aborted ones, its first collective would fail)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.forkedranks import run_ranks

STEPS = 4
FAIL_AT = 3  # the step whose forward fails; steps before it are done in the kept objects


# dp 2 with the survivors a step ahead covers dp 2 with them at the step as well (the same
# reset and regrouping, then a restore of the captured step); tp 2, the tensor-parallel mesh.
@pytest.mark.parametrize("tp,ahead", [(2, False), (1, True)], ids=["tp2", "dp2-a-step-ahead"])
def test_survivors_train_on_in_their_kept_objects_with_the_uninterrupted_losses(tmp_path, tp,
                                                                               ahead):
    """`ahead`: the survivors finished a step past the one the round restores, which their
    last tier-0 snapshot holds: they load it from its host buffers into the kept objects."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(f"{__name__}:_rounds", 2, tmp_path / "ranks", store.port, str(out), tp, ahead,
              str(tmp_path / "snapshots"), env={"OMP_NUM_THREADS": "1"})
    for rank in (0, 1):
        got = json.loads((out / f"r{rank}.json").read_text())
        assert got["failed"], got  # the fault came where it was meant to, mid-forward
        assert got["same_objects"] and got["reused"]
        assert got["before"] + got["after"] == got["reference"], got
        assert len(got["after"]) == STEPS - FAIL_AT + 1 + ahead


def _rounds(rank: int, port: int, out: str, tp: int, ahead: bool, snapshots: str) -> None:
    from pathlib import Path

    import torch

    from lazarus.core.trainconfig import ParallelConfig
    from lazarus.trainer import inplace, kept, meshes
    from lazarus.trainer import snapshot as tier0
    from lazarus.trainer.models import get_model_config
    from lazarus.trainer.optim import build_optimizer
    from lazarus.trainer.parallelize import build_mesh, build_model
    from lazarus.trainer.rankprocess import RankProcess
    from lazarus.trainer.train import train_step

    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False)
    dp = 2 // tp
    par = ParallelConfig(dp=dp, tp=tp)

    def world(name: str, timeout_s: float = 120.0):
        dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank,
                                world_size=2, timeout=timedelta(seconds=timeout_s))
        mesh = build_mesh("cpu", dp=dp, tp=tp)
        meshes.adopt(mesh)  # as lazarus.trainer.train does
        return mesh

    def batch(step: int):
        g = torch.Generator().manual_seed(100 * step + (mesh["dp"].get_local_rank()))
        tokens = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(2)]
        return [(t, t) for t in tokens]

    def step_(model, optimizer, step: int) -> float:
        loss, _norm, _applied = train_step(model, optimizer, batch(step),
                                           device=torch.device("cpu"), grad_clip=1.0,
                                           loss_group=mesh["dp"].get_group())
        return loss

    def leave() -> None:
        assert inplace.release_groups()
        meshes.collect("round")

    # the uninterrupted run
    mesh = world("reference")
    model = build_model(get_model_config("tiny"), mesh, par, seed=3)
    optimizer = build_optimizer(model, lr=1e-3)
    reference = [step_(model, optimizer, s) for s in range(1, STEPS + 1)]
    del model, optimizer
    leave()

    # the round that fails mid-forward at FAIL_AT
    # Short: rank 0's collective with rank 1 fails by this timeout. (A peer that dies resets
    # its sockets and fails it at once; rank 1 only aborts its groups, which gloo's abort
    # does not do: docs/inplace.md.)
    mesh = world("round/1", timeout_s=3.0)
    model = build_model(get_model_config("tiny"), mesh, par, seed=3)
    optimizer = build_optimizer(model, lr=1e-3)
    process = RankProcess()
    process.held = kept.Held("shape", model, optimizer)
    restored = FAIL_AT - 1 - ahead  # the step the next round restores
    Path(snapshots).mkdir(exist_ok=True)
    snapper = tier0.Snapshotter(Path(snapshots), every=1, first_step=0,
                                header={"job": "J", "round": 1, "rank": rank, "world_size": 2},
                                on_written=lambda *_: None)
    before = []
    for s in range(1, FAIL_AT):
        before.append(step_(model, optimizer, s))
        if s == restored:
            snapper.take(s, model, optimizer, {"step": s})
    snapper.close()
    process.held.mark(FAIL_AT - 1, {}, {})
    process.held.captured = snapper.last
    before = before[:restored]
    if rank == 1:
        calls = []

        def fail(*_args):
            calls.append(1)
            if len(calls) == 2:  # the second micro-batch
                raise RuntimeError("injected: this rank's forward fails")
        hook = model.layers[1].register_forward_pre_hook(fail)
    failed = False
    try:
        step_(model, optimizer, FAIL_AT)
    except Exception:  # rank 1's own error; rank 0's collective with it, aborted or timed out
        failed = True
    ids = (id(model), id(optimizer))
    del model, optimizer
    leave()

    # the next world, in the kept objects
    mesh = world("round/2")
    held = kept.take(process, "shape", restoring=True)
    reused = held is not None
    kept.reuse(held)
    if rank == 1:
        hook.remove()
    model, optimizer = held.model, held.optimizer
    if ahead:  # as lazarus.trainer.train does when the captured step is the restored one
        step, tensors, values, header = held.captured
        assert step == restored
        assert tier0.restore_captured(header, tensors, values, model, optimizer)["extra"] == {
            "step": restored}
    after = [step_(model, optimizer, s) for s in range(restored + 1, STEPS + 1)]
    Path(out, f"r{rank}.json").write_text(json.dumps({
        "reference": reference, "before": before, "after": after, "failed": failed,
        "reused": reused, "same_objects": ids == (id(model), id(optimizer))}))
    leave()


def test_a_snapshot_that_fails_in_its_collective_leaves_the_capture_its_buffers_hold(tmp_path):
    """A peer gone while a survivor takes a snapshot (its period agreed by all-reduce): the
    copy has overwritten the buffers of the survivor's previous capture by then. The capture it
    keeps for the next round must name what the buffers hold, the newer step -- not the older
    one, which a round restoring that step would load from them (found by the e2e GPU-fault
    test: losses off from the restored step on)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(f"{__name__}:_failed_take", 2, tmp_path / "ranks", store.port, str(out),
              str(tmp_path / "snapshots"), env={"OMP_NUM_THREADS": "1"})
    got = json.loads((out / "r0.json").read_text())
    assert got["raised"], got
    assert got["captured_step"] == 2 and got["buffers_hold_it"], got


def _failed_take(rank: int, port: int, out: str, snapshots: str) -> None:
    from pathlib import Path

    import torch

    from lazarus.core.trainconfig import ParallelConfig
    from lazarus.trainer import inplace, kept, meshes
    from lazarus.trainer import snapshot as tier0
    from lazarus.trainer.models import get_model_config
    from lazarus.trainer.optim import build_optimizer
    from lazarus.trainer.parallelize import build_mesh, build_model
    from lazarus.trainer.train import take_snapshot, train_step

    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    mesh = build_mesh("cpu", dp=2, tp=1)
    meshes.adopt(mesh)
    model = build_model(get_model_config("tiny"), mesh, ParallelConfig(dp=2, tp=1), seed=3)
    optimizer = build_optimizer(model, lr=1e-3)
    held = kept.Held("shape", model, optimizer)
    Path(snapshots).mkdir(exist_ok=True)
    snapper = tier0.Snapshotter(Path(snapshots), every=0, first_step=0,  # 0: period agreed
                                header={"job": "J", "round": 1, "rank": rank, "world_size": 2},
                                on_written=lambda *_: None)

    def step_(step: int) -> None:
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, 256, (2, 32), generator=g)
        train_step(model, optimizer, [(tokens, tokens)], device=torch.device("cpu"),
                   grad_clip=1.0, loss_group=mesh["dp"].get_group())
        held.mark(step, {"step": step}, {})

    step_(1)
    take_snapshot(snapper, held, 1, model, optimizer, {"step": 1})
    assert held.captured[0] == 1
    step_(2)
    snapper.next_step = 2  # due again at once, whatever period the ranks agreed
    raised = False
    if rank == 0:  # rank 1 is gone before the snapshot's all-reduce: rank 0's times out
        try:
            take_snapshot(snapper, held, 2, model, optimizer, {"step": 2})
        except Exception:  # noqa: BLE001 -- the collective's error, whatever its type
            raised = True
        now, _ = tier0.capture(model, optimizer)
        step, tensors, _values, _header = held.captured
        Path(out, "r0.json").write_text(json.dumps({
            "raised": raised, "captured_step": step,
            "buffers_hold_it": all(torch.equal(tensors[k], now[k]) for k in now)}))
    snapper.close()
    assert inplace.release_groups()
