"""The fused Triton kernels compiled for CUDA against the eager reference computed in float64,
forward and backward, in fp32 and bf16, on non-contiguous inputs, fresh random data each time.

Tolerances are norm-wise relative errors (‖out - ref‖ / ‖ref‖): fp32 math lands far below
1e-5 here; bf16 inputs and outputs carry about 2**-8 relative rounding each."""

from __future__ import annotations

import pytest
import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _strided(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A random tensor of `shape` that is not contiguous: every other column of a wider one."""
    wide = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=torch.float32)
    return wide[..., ::2].to(dtype) if dtype != torch.float32 else wide[..., ::2]


def _check(fused_fn, ref_fn, inputs: list[torch.Tensor], dtype: torch.dtype) -> None:
    fused_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    # The reference in float64 on upcast copies: the truth both paths are measured against.
    ref_in = [(t.detach().double() if t.is_floating_point() else t).requires_grad_(t.is_floating_point())
              for t in inputs]
    out = fused_fn(*fused_in)
    ref = ref_fn(*ref_in)
    cot = torch.randn(out.shape, device="cuda", dtype=torch.float64)
    (out.double() * cot).sum().backward()
    (ref * cot).sum().backward()
    assert _rel(out, ref) < TOL[dtype], f"forward off by {_rel(out, ref):.2e}"
    for i, (a, b) in enumerate(zip(fused_in, ref_in)):
        if a.requires_grad:
            assert a.grad is not None, f"no gradient for input {i}"
            err = _rel(a.grad, b.grad)
            assert err < TOL[dtype], f"gradient of input {i} off by {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "apply_rope", "cross_entropy"])
def test_fused_kernel_matches_float64_reference(op, dtype):
    from lazarus.trainer import kernels
    from lazarus.trainer.models import apply_rope_ref, cross_entropy_ref, rms_norm_ref, swiglu_ref

    torch.manual_seed(torch.seed() % 2**31)  # fresh data every run
    if op == "rms_norm":
        x, w = _strided((4, 256, 2048), dtype), (1 + 0.1 * torch.randn(2048, device="cuda")).to(dtype)
        _check(lambda x, w: kernels.rms_norm(x, w, 1e-5), lambda x, w: rms_norm_ref(x, w, 1e-5),
               [x, w], dtype)
    elif op == "swiglu":
        _check(kernels.swiglu, swiglu_ref, [_strided((4, 256, 4096), dtype),
                                            _strided((4, 256, 4096), dtype)], dtype)
    elif op == "apply_rope":
        angles = torch.randn(256, 32, device="cuda")
        x = _strided((4, 256, 8, 64), dtype)
        _check(lambda x: kernels.apply_rope(x, angles.cos(), angles.sin()),
               lambda x: apply_rope_ref(x, angles.cos().double(), angles.sin().double()), [x], dtype)
    else:
        logits = 3 * _strided((2, 128, 128256), dtype)
        targets = torch.randint(0, 128256, (2, 128), device="cuda")
        targets[0, :5] = -100
        _check(kernels.cross_entropy, cross_entropy_ref, [logits, targets], dtype)


def test_the_kernels_say_they_run_compiled_on_cuda():
    from lazarus.trainer import kernels

    assert kernels.available() == (True, "triton kernels compiled for CUDA tensors")
