"""The Llama-style model: shapes, sizes, deterministic init, causality, reference math."""

import dataclasses
import math

import pytest
import torch

from lazarus.core.batching import layer_bytes_per_token
from lazarus.core.errors import UserError
from lazarus.core.modelconfig import ModelConfig
from lazarus.trainer.models import (
    MODEL_SIZES,
    Transformer,
    apply_rope_ref,
    get_model_config,
    rms_norm_ref,
    swiglu_ref,
)
from lazarus.trainer.models.llama import rope_tables


def tiny(seed: int = 0) -> Transformer:
    model = Transformer(get_model_config("tiny"))
    model.init_weights(seed)
    return model


def test_sizes_are_what_the_names_promise():
    assert tiny().num_params() == MODEL_SIZES["tiny"].num_params() < 1_000_000
    assert 15e6 < MODEL_SIZES["small"].num_params() < 25e6
    assert 1.0e9 < MODEL_SIZES["1b"].num_params() < 2.0e9
    assert 7.5e9 < MODEL_SIZES["8b"].num_params() < 8.5e9
    assert MODEL_SIZES["tiny"].vocab_size == MODEL_SIZES["small"].vocab_size == 256
    for cfg in MODEL_SIZES.values():
        assert cfg.n_kv_heads < cfg.n_heads  # grouped-query attention


def test_unknown_size_is_a_user_error():
    with pytest.raises(UserError, match="unknown model size 'huge'"):
        get_model_config("huge")


def test_forward_shape_and_initial_loss_near_uniform():
    model = tiny()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    assert abs(model.loss(logits, tokens).item() - math.log(256)) < 0.5


def test_init_is_a_function_of_the_seed_also_from_meta():
    a, b, c = tiny(7), tiny(7), tiny(8)
    with torch.device("meta"):
        m = Transformer(get_model_config("tiny"))
    m.to_empty(device="cpu")
    m.init_weights(7)
    for (name, pa), pb, pc, pm in zip(a.named_parameters(), b.parameters(), c.parameters(), m.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pm), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    tokens = torch.randint(0, 256, (1, 8))
    assert torch.equal(a(tokens), m(tokens))  # the rope tables were rebuilt off the meta device


def test_layers_get_distinct_weights():
    model = tiny()
    assert not torch.equal(model.layers[0].attention.wq.weight, model.layers[1].attention.wq.weight)


def test_causal_a_later_token_does_not_change_earlier_logits():
    model = tiny()
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-6)


def test_reference_ops():
    x = torch.randn(3, 5, 8)
    w = torch.randn(8)
    rms = torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(rms_norm_ref(x, w, 1e-5), x / rms * w, atol=1e-6)
    g, u = torch.randn(4, 6), torch.randn(4, 6)
    assert torch.allclose(swiglu_ref(g, u), g * torch.sigmoid(g) * u, atol=1e-6)


def test_rope_rotates_pairs_and_keeps_relative_positions():
    cfg = get_model_config("tiny")
    cos, sin = rope_tables(cfg, "cpu")
    t, d = 6, cfg.head_dim
    q = torch.randn(1, 1, 1, d).expand(1, t, 1, d)
    k = torch.randn(1, 1, 1, d).expand(1, t, 1, d)
    rq, rk = apply_rope_ref(q, cos[:t], sin[:t]), apply_rope_ref(k, cos[:t], sin[:t])
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # a rotation
    assert torch.equal(rq[:, 0], q[:, 0])  # position 0 is not rotated
    # q.k depends only on the distance between positions.
    dots = (rq[0, :, 0, None, :] * rk[0, None, :, 0, :]).sum(-1)
    assert torch.allclose(dots[1, 0], dots[4, 3], atol=1e-5)
    assert torch.allclose(dots[0, 2], dots[3, 5], atol=1e-5)


def _ungrouped(model: Transformer) -> Transformer:
    """The same model with each key/value head copied for every query head it serves (what the
    attention computed before SDPA's enable_gqa): multi-head attention, nothing grouped."""
    cfg = model.cfg
    n_rep = cfg.n_heads // cfg.n_kv_heads
    state = {name: (p.view(cfg.n_kv_heads, cfg.head_dim, cfg.dim).repeat_interleave(n_rep, 0).flatten(0, 1)
                    if name.endswith(("wk.weight", "wv.weight")) else p)
             for name, p in model.state_dict().items()}
    mha = Transformer(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads))
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_equals_copied_key_value_heads(n_kv_heads):
    cfg = dataclasses.replace(get_model_config("tiny"), n_heads=8, n_kv_heads=n_kv_heads)
    model = Transformer(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(tokens), _ungrouped(model)(tokens), rtol=1e-5, atol=1e-5)


def test_activation_estimate_counts_what_a_block_keeps():
    # The tensors one bf16 block saves for its backward (the eager ops), against the count
    # plan_batches sizes micro-batches by. Weights are saved too; they are not activations.
    cfg = ModelConfig(dim=256, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=256,
                      ffn_hidden=896, max_seq_len=64)  # 8b's ratios, small
    model = Transformer(cfg).to(torch.bfloat16)
    model.init_weights(0)
    b, t = 2, 64
    x = torch.randn(b, t, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(saved: torch.Tensor) -> torch.Tensor:
        storage = saved.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved):
        model.layers[0](x, model.rope_cos[:t], model.rope_sin[:t])
    estimate = layer_bytes_per_token(cfg) * b * t
    assert sum(kept.values()) == pytest.approx(estimate, rel=0.05)
