"""Put a model on a 2-D (dp, tp) device mesh: TP -> activation checkpointing -> compile -> FSDP2.

The order matters (torchtitan's): TP rewrites the linears into DTensor modules, checkpointing
and compile wrap the resulting blocks, and FSDP shards last so it sees the TP placements and
shards each weight's dp dimension on top of them.

The TP plan is sequence parallel: norms, embeddings and the output layer are parallelized too,
so every parameter lives on the same 2-D mesh. Mixing 1-D (dp only) and 2-D parameters breaks
clip_grad_norm_ ("All operands in aten.stack.default must have the same mesh"). The output
layer leaves the vocabulary split over TP and the model's loss takes it so (loss parallelism).

Also here, what a GPU run decides about memory: whether gradient accumulation reduces after
every micro-batch (`sync_every_micro_batch`), and what a micro-batch's activations may take
(`activation_budget`, for lazarus.core.batching.plan_batches). docs/architecture.md, "The
trainer on GPUs", has the figures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lazarus.core.batching import ActivationBudget
from lazarus.core.modelconfig import ModelConfig
from lazarus.core.trainconfig import ParallelConfig
from lazarus.trainer.models import Transformer


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
        # Logits stay split on the vocabulary: [B, T, vocab / tp] per rank, not the whole
        # [B, T, 128256] of Llama 3 on every rank (Transformer.loss takes them as they are).
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                  use_local_output=False),
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


def sync_every_micro_batch(device: str, dp: int) -> bool:
    """Whether gradient accumulation reduce-scatters after every micro-batch (True) or only
    after the last (False: FSDP2's set_requires_gradient_sync(False) in between).

    Between reductions FSDP2 keeps every parameter's gradient unsharded, in the reduce dtype:
    on GPUs (bf16 compute, fp32 reduction) 4 bytes x all parameters / tp on each GPU, 32 GB for
    8b, where reducing each micro-batch keeps 4 bytes x parameters / (dp x tp). FSDP2 overlaps
    each layer's reduce-scatter with the backward of the layers below it, so on GPUs the
    memory is worth more than the traffic: every micro-batch, as torchtitan does. On CPU (gloo,
    the tests) the collectives are slow and memory is not short: once a step, as before. dp=1
    has no traffic to save and no memory either (the sharded gradient is the whole one).
    """
    return device == "cuda" and dp > 1


def gradient_sync_for(i: int, n: int, *, every: bool) -> bool:
    """Whether micro-batch i (from 0) of a step's n reduces its gradients: the last always,
    the others when `every` (the model's sync_every_micro_batch)."""
    return every or i == n - 1


# Device memory the activation budget leaves unplanned: the allocator's fragmentation, NCCL's
# buffers, the layers FSDP2 has gathered, and the estimate's own error.
MEMORY_HEADROOM = 0.15


def activation_budget(model: Transformer, cfg: ParallelConfig, *, seq_len: int) -> ActivationBudget | None:
    """What one micro-batch's activations may take on this rank's GPU (plan_batches's
    `memory`); None on CPU, where the plan stays as it always was. Collective on GPUs.

    Call it once the model and its optimizer are built, before the first step: the
    gradients and AdamW's two moments (fp32, 12 bytes a parameter element on this rank) are
    not allocated yet, and are set aside here. Every rank gets the least of all ranks'
    figures: the ranks must agree on the micro-batch, or their FSDP collectives would not
    pair up.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    free, total = torch.cuda.mem_get_info(device)
    budget = torch.tensor(int(free - 12 * local - MEMORY_HEADROOM * total), device=device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return ActivationBudget(model=model.cfg, seq_len=seq_len, tp=cfg.tp,
                            activation_checkpointing=cfg.activation_checkpointing,
                            fused=model.fused_kernels, free_bytes=max(0, int(budget.item())))


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
    model.sync_every_micro_batch = sync_every_micro_batch(mesh.device_type, cfg.dp)
    if init:
        model.init_weights(seed)
    else:
        model.init_buffers()
    return model

