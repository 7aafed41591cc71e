"""The fused Triton kernels against the eager reference math of the Llama model.

There is no GPU here, so the kernels run under the triton interpreter. Triton reads
TRITON_INTERPRET when a kernel is defined, and the pytest process may already have imported
triton or the kernels without it, so every check runs in a fresh interpreter: this file, run as
a script with TRITON_INTERPRET=1, computes fused and reference results (outputs and gradients)
for every case and saves them; the tests compare them. Shapes are tiny: the interpreter is about
300x slower than torch.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# (name, dtype); the worker builds each case from its name.
CASES = [
    (op, dtype)
    for op in ("rms_norm", "swiglu", "apply_rope", "apply_rope_full_table", "cross_entropy",
               "cross_entropy_wide_vocab")
    for dtype in ("float32", "bfloat16")
] + [("cross_entropy_large_logits", "float32"), ("model", "float32")]

# fp32: the kernels do the reference's math in another order. bf16: about one unit in the last
# place (the interpreter truncates fp32 -> bf16 where torch rounds, and the reference rounds some
# intermediates to bf16), i.e. 2**-7 relative: allow 2 ulp, relative only.
TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2**-6, atol=1e-6)}
# Two layers of fp32 matmuls and attention between the fused ops.
MODEL_TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def _run(code: str, *, interpret: bool, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kernels") / "results.pt"
    proc = _run(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"import test_kernels; test_kernels.compute_all({str(out)!r})", interpret=True)
    assert proc.returncode == 0, proc.stderr
    return torch.load(out)


@pytest.mark.parametrize("name,dtype", CASES)
def test_fused_matches_reference(results, name, dtype):
    tol = MODEL_TOLERANCE if name == "model" else TOLERANCE[dtype]
    pairs = results[f"{name}/{dtype}"]
    assert pairs, "case produced nothing"
    for what, (fused, ref) in pairs.items():
        assert fused.dtype == ref.dtype, what
        torch.testing.assert_close(fused, ref, **tol, msg=lambda m: f"{name}/{dtype} {what}: {m}")


def test_cross_entropy_survives_logits_that_overflow_exp(results):
    fused, ref = results["cross_entropy_large_logits/float32"]["out"]
    assert torch.isfinite(fused) and torch.isfinite(ref)


def test_without_gpu_or_interpreter_kernels_refuse_with_a_user_error():
    proc = _run(
        "import torch\n"
        "from lazarus.core.errors import UserError\n"
        "from lazarus.trainer import kernels\n"
        "ok, why = kernels.available()\n"
        "assert not ok, why\n"
        "try:\n"
        "    kernels.swiglu(torch.ones(4), torch.ones(4))\n"
        "except UserError as e:\n"
        "    print(e)\n",
        interpret=False,
    )
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout.strip()
    assert message.startswith("fused swiglu cannot run") and "TRITON_INTERPRET=1" in message


def test_interpreter_flag_set_after_the_kernels_are_defined_is_named():
    proc = _run(
        "import os\n"
        "import lazarus.trainer.kernels.norm\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from lazarus.trainer import kernels\n"
        "print(kernels.available())\n",
        interpret=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "(False, 'TRITON_INTERPRET=1 was set after the kernels were defined" in proc.stdout


# ---- the worker side: runs in the subprocess, under TRITON_INTERPRET=1 ----


def _case(name: str, dtype: torch.dtype):
    """(fused fn, reference fn, inputs) for one case; inputs that are float get gradients."""
    import torch.nn.functional as F

    from lazarus.trainer import kernels
    from lazarus.trainer.models import apply_rope_ref, cross_entropy_ref, rms_norm_ref, swiglu_ref

    if name == "rms_norm":
        x = torch.randn(2, 5, 48, dtype=dtype)
        w = (1 + 0.1 * torch.randn(48)).to(dtype)
        return (lambda x, w: kernels.rms_norm(x, w, 1e-5)), (lambda x, w: rms_norm_ref(x, w, 1e-5)), [x, w]
    if name == "swiglu":
        gate, up = torch.randn(2, 5, 40, dtype=dtype), torch.randn(2, 5, 40, dtype=dtype)
        return kernels.swiglu, swiglu_ref, [gate, up]
    if name.startswith("apply_rope"):
        angles = torch.randn(6, 8)
        cos, sin = angles.cos(), angles.sin()
        x = torch.randn(2, 6, 3, 16, dtype=dtype)
        if name == "apply_rope_full_table":  # [T, D]: the D/2 table written twice
            return (lambda x: kernels.apply_rope(x, cos.repeat(1, 2), sin.repeat(1, 2))), (
                lambda x: apply_rope_ref(x, cos, sin)), [x]
        return (lambda x: kernels.apply_rope(x, cos, sin)), (lambda x: apply_rope_ref(x, cos, sin)), [x]
    if name.startswith("cross_entropy"):
        vocab = 5000 if name == "cross_entropy_wide_vocab" else 300  # 5000: more than one column block
        logits = 3 * torch.randn(2, 4, vocab)
        if name == "cross_entropy_large_logits":
            logits = logits + 1e4  # exp() of these overflows fp32 without the max subtraction
        targets = torch.randint(0, vocab, (2, 4))
        targets[0, 1] = -100  # ignored, and left out of the mean
        return kernels.cross_entropy, cross_entropy_ref, [logits.to(dtype), targets]
    raise AssertionError(name)


def _compare(fused_fn, ref_fn, inputs) -> dict:
    fused_in = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_in = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    fused, ref = fused_fn(*fused_in), ref_fn(*ref_in)
    # a random cotangent, so every output element's gradient path counts
    cotangent = torch.randn(fused.shape).to(fused.dtype)
    (fused * cotangent).sum().backward()
    (ref * cotangent).sum().backward()
    pairs = {"out": (fused.detach(), ref.detach())}
    for i, (a, b) in enumerate(zip(fused_in, ref_in)):
        if a.requires_grad:
            pairs[f"grad{i}"] = (a.grad, b.grad)
    return pairs


def _model_case() -> dict:
    from lazarus.trainer.models import Transformer, get_model_config

    cfg = get_model_config("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    targets = torch.randint(0, cfg.vocab_size, (2, 12))
    losses, grads = [], []
    for fused in (True, False):
        model = Transformer(cfg, fused_kernels=fused).to_empty(device="cpu")
        model.init_weights(seed=7)
        loss = model.loss(model(tokens), targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    pairs = {"loss": (losses[0], losses[1])}
    pairs.update({f"grad {n}": (grads[0][n], grads[1][n]) for n in grads[0]})
    return pairs


def compute_all(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for name, dtype in CASES:
        torch.manual_seed(0)
        if name == "model":
            results[f"{name}/{dtype}"] = _model_case()
        else:
            results[f"{name}/{dtype}"] = _compare(*_case(name, getattr(torch, dtype)))
    torch.save(results, out_path)
