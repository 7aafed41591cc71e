"""Fused kernels under tensor parallelism: gloo ranks, kernels under the triton interpreter.

Each op runs on its local shard; the results and gradients, gathered, must equal the eager
reference on the whole tensors, and the weight gradient of a sequence-sharded RMSNorm must be
summed over the ranks. Then the tiny model trains a few steps on a tp=2 and a dp=2 x tp=2 mesh
(the sequence-parallel plan of parallelize.py, FSDP2 on top) with the fused kernels and with the
eager ops, from the same weights and batches: losses, gradients and the grad norm must agree.
The ranks fork from a server that has not imported the kernels: TRITON_INTERPRET must be set
before they are defined (tests/forkedranks.py).
"""

import pytest
import torch
import torch.distributed as dist

from tests.forkedranks import run_ranks

# fp32: the kernels do the reference's math in another order. bf16: about one unit in the last
# place (the interpreter truncates fp32 -> bf16 where torch rounds): 2 ulp, relative only.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-6, atol=1e-6)}
# Two layers of matmuls and attention between the fused ops, and a few AdamW steps.
MODEL_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
STEPS = 2


def _spawn(tmp_path, *args: str, world: int) -> None:
    run_ranks(f"{__name__}:_rank", world, tmp_path, str(tmp_path / "store"), world, *args,
              env={"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"})


def test_kernels_run_on_local_shards_of_dtensors(tmp_path):
    _spawn(tmp_path, "ops", world=2)


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)])
def test_fused_training_matches_eager_under_tensor_parallelism(tmp_path, dp, tp):
    _spawn(tmp_path, "train", str(dp), str(tp), world=dp * tp)


# ---- the ranks, under TRITON_INTERPRET=1 ----


def _leaf(t: torch.Tensor, mesh, placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.detach(), mesh, placements).requires_grad_()


def _check(fused_fn, ref_fn, inputs, placements, mesh):
    """Run fused on DTensors and the reference on whole tensors; compare outputs and grads."""
    tol = TOLERANCE[inputs[0].dtype]
    dts = [_leaf(t, mesh, p) for t, p in zip(inputs, placements)]
    refs = [t.clone().requires_grad_() for t in inputs]
    out, ref = fused_fn(*dts), ref_fn(*refs)
    assert out.placements == dts[0].placements, out.placements
    torch.testing.assert_close(out.full_tensor(), ref, **tol)
    cotangent = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(ref.dtype)
    (ref * cotangent).sum().backward()
    # each rank weights its own shard of the output with its piece of the same cotangent
    (out.to_local() * _leaf(cotangent, mesh, out.placements).to_local().detach()).sum().backward()
    for dt, r in zip(dts, refs):
        assert dt.grad.placements == dt.placements, (dt.grad.placements, dt.placements)
        torch.testing.assert_close(dt.grad.full_tensor(), r.grad, **tol)


def _ops(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard

    from lazarus.core.errors import UserError
    from lazarus.trainer import kernels
    from lazarus.trainer.models import apply_rope_ref, cross_entropy_ref, rms_norm_ref, swiglu_ref

    torch.manual_seed(0)  # same whole tensors on both ranks
    # sequence parallel: rows split over the ranks, the norm weight replicated
    x, w = torch.randn(2, 6, 16), 1 + 0.1 * torch.randn(16)
    for dtype in (torch.float32, torch.bfloat16):
        _check(lambda x, w: kernels.rms_norm(x, w, 1e-5), lambda x, w: rms_norm_ref(x, w, 1e-5),
               [x.to(dtype), w.to(dtype)], [[Shard(1)], [Replicate()]], mesh)
    # colwise TP: the hidden dim of gate and up split over the ranks
    g, u = torch.randn(2, 6, 20), torch.randn(2, 6, 20)
    _check(kernels.swiglu, swiglu_ref, [g, u], [[Shard(2)], [Shard(2)]], mesh)
    # heads split over the ranks
    angles = torch.randn(6, 4)
    q = torch.randn(2, 6, 4, 8)
    _check(lambda q: kernels.apply_rope(q, angles.cos(), angles.sin()),
           lambda q: apply_rope_ref(q, angles.cos(), angles.sin()), [q], [[Shard(2)]], mesh)

    logits, targets = torch.randn(2, 6, 32), torch.randint(0, 32, (2, 6))
    logits_dt = _leaf(logits, mesh, [Replicate()])
    loss = kernels.cross_entropy(logits_dt, targets)
    ref_logits = logits.clone().requires_grad_()
    ref = cross_entropy_ref(ref_logits, targets)
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits_dt.grad.full_tensor(), ref_logits.grad)

    for call in (lambda: kernels.apply_rope(_leaf(q, mesh, [Shard(1)]), angles.cos(), angles.sin()),
                 lambda: kernels.rms_norm(_leaf(x, mesh, [Shard(2)]), w, 1e-5),
                 lambda: kernels.rms_norm(_leaf(x, mesh, [Shard(1)]), w, 1e-5),  # plain weight
                 lambda: kernels.cross_entropy(_leaf(logits, mesh, [Shard(2)]), targets)):
        try:
            call()
        except UserError:
            continue
        raise AssertionError("an unsupported placement ran")


def _train(mesh, dp: int, tp: int) -> None:
    """A few AdamW steps with the fused kernels and with the eager ops; the two must agree."""
    from torch.distributed.tensor import DTensor

    from lazarus.trainer.models import get_model_config
    from lazarus.trainer.optim import build_optimizer
    from lazarus.trainer.parallelize import ParallelConfig, build_model

    cfg = get_model_config("tiny")
    # each dp rank its own batches; the tp ranks of a dp group share them
    data = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    batches = [torch.randint(0, cfg.vocab_size, (2, 9), generator=data) for _ in range(STEPS)]
    runs = {}
    for fused in (True, False):
        model = build_model(cfg, mesh, ParallelConfig(dp=dp, tp=tp), seed=5, fused_kernels=fused)
        optimizer = build_optimizer(model, lr=1e-2)
        losses, norms = [], []
        for batch in batches:
            loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            # a DTensor over the whole mesh: fails if a parameter's gradient left the 2-D mesh
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor())
            if not losses:
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
        assert all(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in model.parameters())
        runs[fused] = dict(losses=losses, norms=norms, grads=grads)
    for what in ("losses", "norms"):
        torch.testing.assert_close(runs[True][what], runs[False][what], **MODEL_TOLERANCE,
                                   msg=lambda m: f"{what}: {m}")
    # Weights after AdamW are not compared: Adam divides by the root of the squared gradient, so
    # a difference in the seventh digit of a near-zero gradient moves a weight by a whole step.
    # The later losses and grad norms show the updates agree.
    for name, fused in runs[True]["grads"].items():
        torch.testing.assert_close(fused, runs[False]["grads"][name], **MODEL_TOLERANCE,
                                   msg=lambda m: f"grad {name}: {m}")


def _rank(rank: int, store_path: str, world: int, mode: str, *args: str) -> None:
    from lazarus.trainer.parallelize import build_mesh

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    if mode == "ops":
        from torch.distributed.device_mesh import init_device_mesh

        _ops(init_device_mesh("cpu", (world,)))
    else:
        dp, tp = map(int, args)
        _train(build_mesh("cpu", dp=dp, tp=tp), dp, tp)
    dist.destroy_process_group()
