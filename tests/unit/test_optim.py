"""AdamW parameter groups and the learning-rate schedules."""

import math

import pytest
import torch

from lazarus.trainer.models import Transformer, get_model_config
from lazarus.trainer.optim import ScheduleConfig, adamw_implementation, build_optimizer, lr_at


def sched(kind: str, **kw) -> ScheduleConfig:
    base = dict(schedule=kind, lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=100)
    return ScheduleConfig(**{**base, **kw})


def test_no_weight_decay_on_norms_and_embeddings():
    model = Transformer(get_model_config("tiny"))
    opt = build_optimizer(model, lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decayed | plain == set(names.values()) and not decayed & plain
    assert "tok_embeddings.weight" in plain and "norm.weight" in plain
    assert "layers.0.attention_norm.weight" in plain and "layers.1.ffn_norm.weight" in plain
    assert "layers.0.attention.wq.weight" in decayed and "output.weight" in decayed
    assert opt.defaults["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_warmup_is_linear_from_the_first_step(kind):
    cfg = sched(kind)
    assert lr_at(1, cfg) == pytest.approx(1e-4)
    assert lr_at(5, cfg) == pytest.approx(5e-4)
    assert lr_at(10, cfg) == pytest.approx(1e-3)


def test_cosine_decays_smoothly_to_min_lr():
    cfg = sched("cosine")
    lrs = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(150, cfg) == pytest.approx(1e-4)


def test_wsd_is_flat_then_decays_over_the_last_fraction():
    cfg = sched("wsd", decay_fraction=0.2)
    assert all(lr_at(s, cfg) == 1e-3 for s in range(10, 81))
    assert lr_at(90, cfg) == pytest.approx((1e-3 + 1e-4) / 2)
    assert lr_at(100, cfg) == pytest.approx(1e-4)


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_schedule_is_a_pure_function_of_step(kind):
    # A resumed run asks from the step it restored, in a process and with a config of its
    # own: it must get the uninterrupted run's rates, whatever was asked before, in any order.
    run = sched(kind)
    uninterrupted = {s: lr_at(s, run) for s in range(1, 121)}
    assert len(set(uninterrupted.values())) > 25  # a schedule, not a constant
    resumed = sched(kind)
    for s in (40, 77, 3, 120, 40, 1, 99):
        assert lr_at(s, resumed) == uninterrupted[s], s
    assert not math.isnan(lr_at(1, sched(kind, warmup_steps=0, total_steps=1)))


def test_optimizer_step_changes_weights():
    model = Transformer(get_model_config("tiny"))
    model.init_weights(0)
    opt = build_optimizer(model, lr=1e-2)
    before = model.layers[0].feed_forward.w1.weight.clone()
    tokens = torch.randint(0, 256, (2, 9))
    model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    assert not torch.equal(before, model.layers[0].feed_forward.w1.weight)


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere():
    assert adamw_implementation("cuda") == {"fused": True}
    assert adamw_implementation("cpu") == {"foreach": True}
    # CPU keeps the foreach AdamW its runs have always used: their numbers do not move.
    opt = build_optimizer(Transformer(get_model_config("tiny")), lr=1e-3)
    assert all(g["foreach"] is True and not g["fused"] for g in opt.param_groups)
