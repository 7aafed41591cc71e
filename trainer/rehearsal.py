"""A training step rehearsed in the worker zygote, so that the ranks forked after it start
with DTensor's caches filled (docs/inplace.md, "As built", 6).

A fresh rank's first FSDP2/DTensor step spent 0.73 of its 0.8 s here in sharding propagation
missing its cache (AdamW's foreach ops, gradient clipping); the second step took 0.06-0.1 s.
Those caches are per process and keyed by each op's specs: the mesh (its shape, names and
device type, not the rank), the placements and the tensors' shapes. So one step of the same
model on the same mesh shape fills them for every rank, and a fork inherits them.

The step runs on torch's fake process group (collectives that move nothing) and under
FakeTensorMode (tensors with shapes and no storage): no kernel runs, so the zygote starts no
OpenMP pool and allocates nothing of the model's size (lazarus.trainer.zygote says why it
must not), whatever the model. The meshes it leaves in the caches are rank 0's; a rank
forked afterwards makes them its own (lazarus.trainer.meshes).

CPU meshes only: on a GPU node the ranks' meshes are CUDA's, and building one in the zygote
would initialise the driver its forks need uninitialised. Not with torch.compile or the
fused kernels either: their first step is compilation, not propagation.
"""

from __future__ import annotations

import os

from lazarus.core.batching import plan_batches
from lazarus.core.trainconfig import TrainConfig


def why_not(cfg: TrainConfig, world_size: int, device: str) -> str | None:
    """Why this step is not rehearsed, or None when it is."""
    if device != "cpu":
        return f"the ranks' device is {device}, and only CPU meshes are rehearsed"
    if cfg.parallelism.compile:
        return "torch.compile: its first step is compilation"
    if cfg.model.fused_kernels:
        return "fused kernels: their first step is compilation"
    if cfg.parallelism.dp * cfg.parallelism.tp != world_size:
        return f"mesh {cfg.parallelism.dp} x {cfg.parallelism.tp} is not {world_size} ranks"
    return None


def rehearse(train: dict, world_size: int, device: str) -> str:
    """One step of the built-in trainer's job `train` (TrainConfig's dict) on a fake world of
    `world_size` ranks: "rehearsed", or "skipped: why". Raises what the step raised; the
    process group is gone and the meshes collected either way. The agent asks once per job
    shape (lazarus.agent.zygote.Zygote.rehearse); asked again, it runs again."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    # Registers the "fake" backend: a process group that moves no data (torch's own).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # here, as torch above: only a rehearsal loads what it runs
    from lazarus.trainer import meshes
    from lazarus.trainer.models import Transformer, get_model_config
    from lazarus.trainer.optim import build_optimizer
    from lazarus.trainer.parallelize import build_mesh, parallelize, sync_every_micro_batch
    from lazarus.trainer.train import finish_step, forward_backward

    cfg = TrainConfig.from_dict(train)
    if why := why_not(cfg, world_size, device):
        return f"skipped: {why}"
    par, data = cfg.parallelism, cfg.data
    plan = plan_batches(data.global_batch, par.dp, data.micro_batch)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = build_mesh("cpu", dp=par.dp, tp=par.tp)
        with torch.device("meta"):
            model = Transformer(get_model_config(cfg.model.name))
        # Sharded on the meta device, outside the fake mode: placing a TP mesh's ranks runs
        # data-dependent ops (nonzero) that fake tensors cannot.
        parallelize(model, mesh, par)
        model.sync_every_micro_batch = sync_every_micro_batch("cpu", par.dp)
        # allow_non_fake_inputs: the meshes' own rank tensors are real
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.init_buffers()
            optimizer = build_optimizer(model, lr=cfg.optimizer.lr,
                                        weight_decay=cfg.optimizer.weight_decay)
            tokens = torch.zeros((plan.micro_batch, data.seq_len), dtype=torch.long)
            micro = [(tokens, tokens)] * min(2, plan.accumulation)
            loss, grad_norm = forward_backward(model, micro, device=torch.device("cpu"),
                                               loss_group=mesh["dp"].get_group())
            finish_step(model, optimizer, grad_norm, grad_clip=cfg.optimizer.grad_clip,
                        apply=True)
    finally:
        dist.destroy_process_group()
        meshes.collect("rehearsal")
    return "rehearsed"


def zygote_device() -> str:
    """The device the ranks will use, told the zygote's way: torch's CUDA check through NVML,
    which leaves the driver uninitialised (lazarus.trainer.zygote)."""
    # here: device loads torch, which this module loads only when it rehearses
    from lazarus.trainer.device import device_type
    from lazarus.trainer.zygote import NVML_CHECK

    had = NVML_CHECK in os.environ
    os.environ.setdefault(NVML_CHECK, "1")
    try:
        return device_type()
    finally:
        if not had:
            os.environ.pop(NVML_CHECK, None)
