"""Checkpoints: what a recovery relies on.

A checkpoint saved by 4 gloo ranks at dp2 x tp2 (FSDP2 + TP, AdamW) loads bit-exactly at
1x2, 2x1 and 4x1 and trains on from there; a save that never committed is invisible; a
damaged file is caught before anything is loaded; retention, rollback and the async contract
hold. The model is a small stand-in with the same parallelism as the trainer's.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from lazarus.core.errors import CheckpointError
from lazarus.trainer.ckptdir import claim
from lazarus.trainer.ckptfiles import MANIFEST, OWNER, checkpoint_dir, file_entry
from lazarus.trainer.ckptlist import committed_checkpoints, latest_checkpoint, read_manifest
from lazarus.trainer.ckptload import load_checkpoint
from lazarus.trainer.ckptsave import Checkpointer
from lazarus.trainer.export import export_safetensors
from lazarus.trainer.rngstate import reseed_value
from tests.forkedranks import run_ranks

LAUNCH_TIMEOUT_S = 300


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def build(seed: int, dp: int = 0, tp: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """TinyNet + AdamW; with (dp, tp) on a 2-D mesh: TP on up/down, then FSDP2 over dp."""
    torch.manual_seed(seed)
    model = TinyNet()
    if dp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                    weight_decay=0.1)


def train_step(model, optimizer, step: int) -> None:
    # The same global batch at every mesh: each dp rank takes its rows of it.
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
    if dist.is_initialized():
        from torch.distributed.tensor import DTensor
        mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
        dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        # FSDP averages gradients over dp ranks: scale so the step equals the whole batch's.
        loss = model(x.chunk(dp)[dp_rank]).pow(2).sum() * dp / 8
    else:
        loss = model(x).pow(2).sum() / 8
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every weight and optimizer tensor, unsharded, by name (collective)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True)
    out = {f"model.{k}": v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    for fqn, state in optim["state"].items():
        out |= {f"optim.{fqn}.{k}": torch.as_tensor(v).clone() for k, v in state.items()}
    return out


# ---------------------------------------------------------------------------------------------
# Launching gloo ranks


def _ranked(rank: int, fn: str, world: int, store: str, out: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        globals()[fn](rank, world, Path(out), *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn, world: int, out: Path, *args) -> None:
    """Run fn(rank, world, out, *args) on `world` gloo processes forked from a server that
    imported torch once (tests/forkedranks.py), all done within LAUNCH_TIMEOUT_S."""
    store = out / f"store-{time.monotonic_ns()}"
    run_ranks(f"{__name__}:_ranked", world, out, fn.__name__, world, str(store), str(out), args,
              timeout_s=LAUNCH_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------
# Multi-process: save at dp2 x tp2, load at other meshes


def _save_at_2x2(rank: int, world: int, out: Path, root: str) -> None:
    model, optimizer = build(seed=0, dp=2, tp=2)
    checkpointer = Checkpointer(Path(root), keep_last=3)
    train_step(model, optimizer, 1)
    reference = full_state(model, optimizer)
    checkpointer.save(1, model, optimizer, {"step": 1, "loader": {"cursor": 64}})
    # Training goes on while the save is written: the checkpoint must hold step 1 anyway.
    rng_after_save = torch.rand(4).tolist()
    train_step(model, optimizer, 2)
    assert checkpointer.wait() == checkpoint_dir(Path(root), 1)
    after_step2 = full_state(model, optimizer)
    # A save whose round went stale: written by every rank, never committed.
    checkpointer.save(2, model, optimizer, {"step": 2}, commit_gate=lambda step: False)
    assert checkpointer.wait() is None
    checkpointer.close()
    (out / f"rng-{rank}.json").write_text(json.dumps(rng_after_save))
    if rank == 0:
        save_file(reference, str(out / "step1.safetensors"))
        save_file(after_step2, str(out / "step2.safetensors"))


def _load_at(rank: int, world: int, out: Path, root: str, dp: int, tp: int) -> None:
    model, optimizer = build(seed=99, dp=dp, tp=tp)
    train_step(model, optimizer, 7)  # different weights and optimizer state to overwrite
    path = latest_checkpoint(Path(root))
    assert path == checkpoint_dir(Path(root), 1), path  # step 2 never committed
    extra = load_checkpoint(path, model, optimizer)
    assert extra == {"step": 1, "loader": {"cursor": 64}}
    drawn = torch.rand(4).tolist()
    if world == 4:  # same world as the save: each rank continues its own RNG stream
        assert drawn == json.loads((out / f"rng-{rank}.json").read_text())
    else:
        g = torch.Generator().manual_seed(reseed_value(1, rank))
        assert drawn == torch.rand(4, generator=g).tolist()
    loaded = full_state(model, optimizer)
    reference = load_file(str(out / "step1.safetensors"))
    assert loaded.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(loaded[name], value), name
    train_step(model, optimizer, 2)  # resumes training: optimizer step count, moments, lr
    after = full_state(model, optimizer)
    for name, value in load_file(str(out / "step2.safetensors")).items():
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("ckpt-2x2")
    root = out / "checkpoints"
    launch(_save_at_2x2, 4, out, str(root))
    return out, root


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 1), (4, 1)])
def test_checkpoint_from_2x2_loads_at_another_mesh_and_trains_on(saved_2x2, dp, tp):
    out, root = saved_2x2
    launch(_load_at, dp * tp, out, str(root), dp, tp)


def test_uncommitted_save_of_a_stale_round_is_on_disk_but_never_loaded(saved_2x2):
    _, root = saved_2x2
    stale = checkpoint_dir(root, 2)
    assert (stale / ".metadata").exists() and not (stale / MANIFEST).exists()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(stale, *build(seed=0))


def test_export_writes_the_unsharded_weights_without_a_process_group(saved_2x2, tmp_path):
    out, root = saved_2x2
    exported = tmp_path / "model.safetensors"
    export_safetensors(checkpoint_dir(root, 1), exported)
    reference = load_file(str(out / "step1.safetensors"))
    weights = load_file(str(exported))
    assert weights.keys() == {"up.weight", "up.bias", "down.weight", "down.bias", "head.weight"}
    for name, value in weights.items():
        assert torch.equal(value, reference[f"model.{name}"]), name
    model = TinyNet()
    model.load_state_dict(weights)  # the plain model reads it as its own


# ---------------------------------------------------------------------------------------------
# Single process: commit, verification, retention, async contract


def _trained(seed: int = 0):
    model, optimizer = build(seed)
    train_step(model, optimizer, 1)
    return model, optimizer


def test_missing_and_incomplete_checkpoints_are_rejected_and_never_listed(tmp_path):
    model, optimizer = _trained()
    checkpointer = Checkpointer(tmp_path, keep_last=5)
    checkpointer.save(1, model, optimizer, {}, async_save=False)
    checkpointer.save(2, model, optimizer, {}, async_save=False, commit_gate=lambda s: False)
    checkpointer.close()
    assert not (checkpoint_dir(tmp_path, 2) / MANIFEST).exists()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    assert [p for p, _ in committed_checkpoints(tmp_path)] == [latest_checkpoint(tmp_path)]
    with pytest.raises(CheckpointError, match=r"step-00000002 is incomplete: no manifest.json"):
        load_checkpoint(checkpoint_dir(tmp_path, 2), model, optimizer)
    with pytest.raises(CheckpointError, match="step-00000009 does not exist"):
        load_checkpoint(checkpoint_dir(tmp_path, 9), model, optimizer)
    assert latest_checkpoint(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_is_detected_before_loading(tmp_path, damage):
    model, optimizer = _trained()
    with_weights = {k: v.clone() for k, v in model.state_dict().items()}
    Checkpointer(tmp_path, keep_last=1).save(1, model, optimizer, {}, async_save=False)
    shard = checkpoint_dir(tmp_path, 1) / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x10
        shard.write_bytes(bytes(raw))
    elif damage == "truncate":
        shard.write_bytes(bytes(raw[:-1]))
    else:
        shard.unlink()
    fresh, fresh_optimizer = _trained(seed=5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    expected = {"flip": "__0_0.distcp fails its sha256", "truncate": "__0_0.distcp has",
                "delete": "__0_0.distcp is missing"}[damage]
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(checkpoint_dir(tmp_path, 1), fresh, fresh_optimizer)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert not all(torch.equal(with_weights[k], v) for k, v in fresh.state_dict().items())


def test_retention_keeps_the_last_n_commits_and_follows_a_rollback(tmp_path):
    model, optimizer = _trained()
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    crashed = checkpoint_dir(tmp_path, 3)  # a save that died mid-write, long ago
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    for step in (10, 20, 30):
        checkpointer.save(step, model, optimizer, {"step": step})
    checkpointer.wait()
    names = lambda: sorted(p.name for p in tmp_path.iterdir())
    assert names() == ["step-00000020", "step-00000030"]
    # Roll back to 20 and save 25 and then 30 again, with other weights: the newest commit
    # wins over the abandoned timeline's step 30, which is rewritten, not trusted.
    load_checkpoint(checkpoint_dir(tmp_path, 20), model, optimizer)
    checkpointer.save(25, model, optimizer, {"step": 25})
    assert checkpointer.wait() == checkpoint_dir(tmp_path, 25)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 25)
    assert names() == ["step-00000025", "step-00000030"]
    with torch.no_grad():
        model.head.weight.fill_(0.5)
    checkpointer.save(30, model, optimizer, {"step": 30, "timeline": 2})
    checkpointer.close()
    assert names() == ["step-00000025", "step-00000030"]
    fresh, fresh_optimizer = _trained(seed=3)
    assert load_checkpoint(latest_checkpoint(tmp_path), fresh, fresh_optimizer)["timeline"] == 2
    assert (fresh.head.weight == 0.5).all()


def test_a_checkpoint_dir_is_one_jobs_and_retention_never_deletes_another_jobs(tmp_path):
    """Issue 12: a second job given the first one's dir started from scratch and its
    retention deleted the first job's checkpoints."""
    model, optimizer = _trained()
    assert claim(tmp_path, "job-a", adopt=False) is None
    first = Checkpointer(tmp_path, keep_last=1, job_id="job-a")
    for step in (5, 10):
        first.save(step, model, optimizer, {"step": step}, async_save=False)
    first.close()
    why = claim(tmp_path, "job-b", adopt=False)    # another job: refused, and told why
    assert "belongs to job job-a" in why and "steps 10" in why and "checkpoint.resume" in why
    assert claim(tmp_path, "job-a", adopt=False) is None  # its own job (a restart)
    # Told to start from them, job-b adopts the dir; its retention removes only its own.
    assert claim(tmp_path, "job-b", adopt=True) is None
    second = Checkpointer(tmp_path, keep_last=1, job_id="job-b")
    for step in (15, 20, 25):
        second.save(step, model, optimizer, {"step": step}, async_save=False)
    second.close()
    assert [(p.name, m["job_id"]) for p, m in committed_checkpoints(tmp_path)] == [
        ("step-00000010", "job-a"), ("step-00000025", "job-b")]
    assert "belongs to job job-b" in claim(tmp_path, "job-a", adopt=False)
    # A dir from before ownership (manifests without a job id) is nobody's to take over.
    legacy = tmp_path / "legacy"
    Checkpointer(legacy, keep_last=1).save(1, model, optimizer, {"step": 1}, async_save=False)
    (checkpoint_dir(legacy, 1) / MANIFEST).write_text(json.dumps(
        {k: v for k, v in read_manifest(checkpoint_dir(legacy, 1)).items()
         if k != "job_id"}))
    assert "belongs to job (unnamed)" in claim(legacy, "job-c", adopt=False)
    # A garbled owner file is named, and nothing is claimed over it.
    (legacy / OWNER).write_bytes(b"\xff{not json")
    assert ".lazarus-job cannot be read" in claim(legacy, "job-c", adopt=True)
    assert (legacy / OWNER).read_bytes() == b"\xff{not json"


def test_async_save_returns_before_the_commit_and_the_next_save_waits(tmp_path):
    model, optimizer = _trained()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    release = threading.Event()
    events: list[str] = []

    def slow_gate(step: int) -> bool:
        release.wait()
        events.append(f"commit {step}")
        return True

    checkpointer = Checkpointer(tmp_path, keep_last=5)
    checkpointer.save(1, model, optimizer, {"step": 1}, commit_gate=slow_gate)
    events.append("save 1 returned")
    assert latest_checkpoint(tmp_path) is None  # still in flight
    with torch.no_grad():  # the training loop moves on; the checkpoint must not follow
        for p in model.parameters():
            p.add_(1.0)

    def second_save():
        checkpointer.save(2, model, optimizer, {"step": 2})
        events.append("save 2 returned")

    second = threading.Thread(target=second_save)
    second.start()
    time.sleep(0.5)  # give a save that does not wait the chance to return early
    events.append("gate released")
    release.set()
    second.join()
    assert checkpointer.wait() == checkpoint_dir(tmp_path, 2)
    checkpointer.close()
    assert events == ["save 1 returned", "gate released", "commit 1", "save 2 returned"]
    fresh, fresh_optimizer = _trained(seed=4)
    assert load_checkpoint(checkpoint_dir(tmp_path, 1), fresh, fresh_optimizer) == {"step": 1}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, at_save[name]), name


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_pickle_with_foreign_objects_is_refused(tmp_path, monkeypatch):
    model, optimizer = _trained()
    Checkpointer(tmp_path, keep_last=1).save(1, model, optimizer, {}, async_save=False)
    path = checkpoint_dir(tmp_path, 1)
    # An attacker who can write the directory can also fix up the manifest's checksums.
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    manifest = json.loads((path / MANIFEST).read_text())
    for entry in manifest["files"]:
        entry |= file_entry(path, entry["name"])
    (path / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="posix.system is not allowed in DCP metadata"):
        load_checkpoint(path, model, optimizer)
    assert not (tmp_path / "pwned").exists()


def test_a_fresh_optimizer_is_loaded_without_a_step_of_its_own(tmp_path, monkeypatch):
    # DCP would make the state with a zero-gradient step over every shard, all of it then
    # read over; the load allocates it from the checkpoint's metadata instead.
    model, optimizer = _trained()
    Checkpointer(tmp_path, keep_last=1).save(1, model, optimizer, {"step": 1}, async_save=False)
    fresh, fresh_optimizer = build(seed=5)
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda *a, **k: pytest.fail("stepped"))
    assert load_checkpoint(checkpoint_dir(tmp_path, 1), fresh, fresh_optimizer) == {"step": 1}
    monkeypatch.undo()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        assert optimizer.state[p].keys() == fresh_optimizer.state[q].keys()
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, fresh_optimizer.state[q][key]), key
