"""Put a model on a 2-D (dp, tp) device mesh: TP -> activation checkpointing -> compile -> FSDP2.

The order matters (torchtitan's): TP rewrites the linears into DTensor modules, checkpointing
and compile wrap the resulting blocks, and FSDP shards last so it sees the TP placements and
shards each weight's dp dimension on top of them.

The TP plan is sequence parallel: norms, embeddings and the output layer are parallelized too,
so every parameter lives on the same 2-D mesh. Mixing 1-D (dp only) and 2-D parameters breaks
clip_grad_norm_ ("All operands in aten.stack.default must have the same mesh").
"""

from __future__ import annotations

import torch
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lazarus.core.modelconfig import ModelConfig
from lazarus.core.trainconfig import ParallelConfig
from lazarus.trainer.models import Transformer


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def build_mesh(device: str, *, dp: int, tp: int) -> DeviceMesh:
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    if dp > 1 and tp > 1:
        # A flattened view lets DTensor reduce over both dims in one collective (the global
        # grad norm) instead of two in a row.
        mesh["dp", "tp"]._flatten("dp_tp")
    return mesh


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    # Between blocks the residual stream is split along the sequence (Shard(1)); attention and
    # the MLP gather it, compute on their share of heads / hidden units, and scatter it back.
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, device: str) -> None:
    # bf16 compute with fp32 gradient reduction on GPUs; CPUs (tests) keep fp32 throughout.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if device == "cuda" else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    if cfg.tp > 1:
        apply_tp(model, mesh["tp"])
    if cfg.activation_checkpointing:
        # The composable form keeps parameter names unchanged, so checkpoints taken with and
        # without it are interchangeable.
        for block in model.layers:
            checkpoint(block)
    if cfg.compile:
        for block in model.layers:
            block.compile()
    apply_fsdp(model, mesh["dp"], mesh.device_type)


def build_model(model_cfg: ModelConfig, mesh: DeviceMesh, cfg: ParallelConfig, *, seed: int,
                fused_kernels: bool = False, init: bool = True) -> Transformer:
    """The sharded model, materialised on this rank's device and initialised from `seed`.

    Built on the meta device first: no rank ever holds the whole unsharded model. `init`
    False: the parameters are left as allocated, for a restore to fill -- drawing them costs
    time in proportion to the whole model on every rank (each draws the full weight and
    keeps its shard), which a recovery would spend for nothing.
    """
    with torch.device("meta"):
        model = Transformer(model_cfg, fused_kernels=fused_kernels)
    parallelize(model, mesh, cfg)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    model.to_empty(device=device)
    if init:
        model.init_weights(seed)
    else:
        model.init_buffers()
    return model

