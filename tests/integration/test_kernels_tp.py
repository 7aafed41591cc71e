"""Fused kernels on tensor-parallel DTensors: two gloo ranks, kernels under the triton interpreter.

Each op runs on its local shard; the results and gradients, gathered, must equal the eager
reference on the whole tensors, and the weight gradient of a sequence-sharded RMSNorm must be
summed over both ranks. Runs as a fresh script: TRITON_INTERPRET must be set before the kernels
are defined.
"""

import os
import subprocess
import sys

import torch
import torch.distributed as dist


def test_kernels_run_on_local_shards_of_dtensors(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("rank ok") == 2, proc.stdout


def _leaf(t: torch.Tensor, mesh, placements):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.detach(), mesh, placements).requires_grad_()


def _check(fused_fn, ref_fn, inputs, placements, mesh):
    """Run fused on DTensors and the reference on whole tensors; compare outputs and grads."""
    dts = [_leaf(t, mesh, p) for t, p in zip(inputs, placements)]
    refs = [t.clone().requires_grad_() for t in inputs]
    out, ref = fused_fn(*dts), ref_fn(*refs)
    torch.testing.assert_close(out.full_tensor(), ref)
    cotangent = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * cotangent).sum().backward()
    # each rank weights its own shard of the output with its piece of the same cotangent
    (out.to_local() * _leaf(cotangent, mesh, out.placements).to_local().detach()).sum().backward()
    for dt, r in zip(dts, refs):
        assert dt.grad.placements == dt.placements, (dt.grad.placements, dt.placements)
        torch.testing.assert_close(dt.grad.full_tensor(), r.grad)


def _rank(rank: int, store_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from lazarus.core.errors import UserError
    from lazarus.trainer import kernels
    from lazarus.trainer.models import apply_rope_ref, cross_entropy_ref, rms_norm_ref, swiglu_ref

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # same whole tensors on both ranks

    # sequence parallel: rows split over the ranks, the norm weight replicated
    x, w = torch.randn(2, 6, 16), 1 + 0.1 * torch.randn(16)
    _check(lambda x, w: kernels.rms_norm(x, w, 1e-5), lambda x, w: rms_norm_ref(x, w, 1e-5),
           [x, w], [[Shard(1)], [Replicate()]], mesh)
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
                 lambda: kernels.cross_entropy(_leaf(logits, mesh, [Shard(2)]), targets)):
        try:
            call()
        except UserError:
            continue
        raise AssertionError("an unsupported placement ran")
    dist.destroy_process_group()
    print("rank ok", flush=True)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(sys.argv[1],), nprocs=2)
