"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Architecture only: no parallelism and no training loop live here. The module works the same on
plain tensors and on the tensor-parallel DTensors parallelize.py gives it, because every shape it
needs is read from the tensors (a TP rank sees n_heads / tp heads), and its loss takes logits
whose vocabulary TP splits as they are (`vocab_parallel_cross_entropy`).

The four eager functions `rms_norm_ref`, `swiglu_ref`, `apply_rope_ref` and `cross_entropy_ref`
are the reference math the fused Triton kernels in lazarus.trainer.kernels must match.
"""

from __future__ import annotations

import hashlib
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from lazarus.core.errors import UserError
from lazarus.core.modelconfig import ModelConfig


# ---- reference math (the fused kernels are checked against these) ----

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2 over the last dim) + eps) * weight, computed in fp32, cast to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[B, T, H, D] by position: cos and sin are [T, D/2].

    "Rotate half" pairing: element i is paired with element i + D/2 (not with its neighbour),
    computed in fp32 and cast back to x's dtype.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :].float(), sin[None, :, None, :].float()
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).to(x.dtype)


def cross_entropy_ref(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of logits[B, T, V] against targets[B, T], in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


_KERNEL_NAMES = ("rms_norm", "swiglu", "apply_rope", "cross_entropy")


def select_ops(fused: bool) -> SimpleNamespace:
    """The four ops the model and the loss use: the eager references, or the fused kernels."""
    if not fused:
        return SimpleNamespace(rms_norm=rms_norm_ref, swiglu=swiglu_ref,
                               apply_rope=apply_rope_ref, cross_entropy=cross_entropy_ref)
    try:
        import lazarus.trainer.kernels as kernels  # here: optional, and only fused ops need them
    except ImportError as e:
        raise UserError(f"fused_kernels is on but lazarus.trainer.kernels does not import: {e}") from None
    missing = [n for n in _KERNEL_NAMES if not hasattr(kernels, n)]
    if missing:
        raise UserError(f"fused_kernels is on but lazarus.trainer.kernels lacks {', '.join(missing)}")
    ok, why = kernels.available()
    if not ok:
        raise UserError(f"fused_kernels is on but the kernels cannot run here: {why}")
    return SimpleNamespace(**{n: getattr(kernels, n) for n in _KERNEL_NAMES})


def rope_tables(cfg: ModelConfig, device: torch.device | str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq_len, head_dim / 2], in fp32."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


# ---- modules ----

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: SimpleNamespace):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: SimpleNamespace):
        super().__init__()
        self.ops = ops
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds only its share of the heads.
        q = self.ops.apply_rope(self.wq(x).view(b, t, -1, self.head_dim), cos, sin)
        k = self.ops.apply_rope(self.wk(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # Query head i reads key/value head i // (q heads / kv heads), without K and V copied
        # that many times. A TP rank holds a contiguous block of each, so the grouping holds
        # on its share too. Only when the counts differ: GQA rules out some kernels.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: SimpleNamespace):
        super().__init__()
        self.ops = ops
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: SimpleNamespace):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attention = Attention(cfg, ops)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.feed_forward = FeedForward(cfg, ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, fused_kernels: bool = False):
        super().__init__()
        self.cfg = cfg
        self.fused_kernels = fused_kernels
        self.ops = select_ops(fused_kernels)
        # Whether gradient accumulation reduces the gradients after every micro-batch, not
        # only after the last (set by lazarus.trainer.parallelize, which knows the device).
        self.sync_every_micro_batch = False
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, self.ops) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, self.ops)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg, None)  # the default device: meta when built for sharding
        # Not persistent: derived from the config, so checkpoints carry weights only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy, a plain 0-dim tensor (the same on every TP rank)."""
        if _vocab_sharded(logits):
            # The fused kernel needs whole rows: it would have to gather the very [B, T, vocab]
            # per rank that splitting the vocabulary saves.
            return vocab_parallel_cross_entropy(logits, targets)
        return self.ops.cross_entropy(logits, targets)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The tables derived from the config (not in checkpoints): all a model materialised
        from the meta device needs before a restore fills its parameters."""
        cos, sin = rope_tables(self.cfg, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from `seed` alone: the same seed gives the same model whatever
        the data-parallel degree, and works on a model materialised from the meta device.

        Each parameter draws from its own stream keyed by (seed, name). Where tensor
        parallelism splits a weight, each TP shard draws from a stream keyed by (seed, name,
        tp_rank): with one stream per weight every shard would be a copy of the first (the
        SmolLM3 bug), leaving the shards' units identical for the whole run.
        """
        self.init_buffers()
        # Residual-branch outputs are scaled down with depth (GPT-2 style) so the residual
        # stream's variance does not grow with the number of layers.
        depth_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            name = _canonical(name)
            if name.endswith("norm.weight"):
                _fill(param, name, seed, lambda shape, gen: torch.ones(shape))
                continue
            if name.endswith(("wo.weight", "w2.weight")):
                std = depth_std
            elif name == "output.weight":
                std = self.cfg.dim ** -0.5
            else:
                std = 0.02
            _fill(param, name, seed, lambda shape, gen, std=std: nn.init.trunc_normal_(
                torch.empty(shape), std=std, a=-3 * std, b=3 * std, generator=gen))


def _vocab_sharded(logits: torch.Tensor) -> bool:
    return isinstance(logits, DTensor) and any(
        isinstance(p, Shard) and p.dim % logits.ndim == logits.ndim - 1 for p in logits.placements)


def vocab_parallel_cross_entropy(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """cross_entropy_ref of logits[B, T, V] split over TP on V (a DTensor on a 1-D mesh), by
    torch's loss parallelism: each rank keeps [B, T, V / tp], and the ranks exchange a few
    numbers per token (the max, the sum of exponentials, the target's logit). Returns a plain
    0-dim tensor, the whole loss on every rank; its backward needs nothing of the caller."""
    return _LossParallel.apply(logits, targets)


class _LossParallel(torch.autograd.Function):
    # loss_parallel() must be on during the backward too (without it the backward fails on
    # the sharded log-probabilities), and the loop's loss.backward() is none of the model's
    # business: the loss is built on a graph of its own, whose backward this node runs under
    # loss_parallel() when the gradient arrives.

    @staticmethod
    def forward(ctx, logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_(logits.requires_grad)
            loss = F.cross_entropy(leaf.flatten(0, 1).float(), targets.flatten())
        ctx.leaf, ctx.loss = leaf, loss
        return loss.to_local().clone()  # Replicate: each rank's copy is the whole loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        seed = DTensor.from_local(grad, ctx.loss.device_mesh, ctx.loss.placements, run_check=False)
        with loss_parallel():
            (dlogits,) = torch.autograd.grad(ctx.loss, ctx.leaf, seed)
        return dlogits, None


def _canonical(name: str) -> str:
    # Wrappers (activation checkpointing, compile) add path components; streams follow the
    # model's own names so they do not depend on those switches.
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _stream(seed: int, name: str, tp_rank: int | None) -> torch.Generator:
    key = f"{seed}/{name}/{'-' if tp_rank is None else tp_rank}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)


def _fill(param: torch.Tensor, name: str, seed: int, make) -> None:
    """Write make(shape, generator) into `param`, which may be a DTensor on a (dp, tp) mesh."""
    if not isinstance(param, DTensor):
        param.copy_(make(tuple(param.shape), _stream(seed, name, None)))
        return
    mesh, placements = param.device_mesh, param.placements
    tp_dim = mesh.mesh_dim_names.index("tp") if "tp" in (mesh.mesh_dim_names or ()) else None
    shard_dim = None
    if tp_dim is not None and isinstance(placements[tp_dim], Shard):
        shard_dim = placements[tp_dim].dim
    if shard_dim is None:
        full = make(tuple(param.shape), _stream(seed, name, None))
    else:
        # Every rank builds the whole weight from the per-TP-rank streams and keeps its own
        # piece; the result then depends on (seed, tp) only, not on which rank computed it.
        tp = mesh.size(tp_dim)
        shape = list(param.shape)
        shape[shard_dim] //= tp
        full = torch.cat([make(tuple(shape), _stream(seed, name, r)) for r in range(tp)], dim=shard_dim)
    local = distribute_tensor(full.to(param.device, param.dtype), mesh, placements, src_data_rank=None)
    param.to_local().copy_(local.to_local())

