"""The GPU figures tests/gpu/run.sh prints: the fused kernels' speed against eager and
torch.compile, the trainer's tokens/s, MFU and peak memory at the 1b preset (fused and eager)
against a plain eager loop of the same model, `lazarus train`'s forked rank starts against
cold ones, and the tier-0 stall against a pinned
device-to-host copy of the same bytes. Timings are medians of CUDA-event-timed repeats after
warm-up (triton.testing.do_bench), or of steady-state steps.

    python tests/gpu/figures.py OUT_DIR [--steps N] [--seq-len T] [--batch B]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

TABLE: list[tuple[str, str]] = []


def row(what: str, value: str) -> None:
    TABLE.append((what, value))
    print(f"{what:<58} {value}", flush=True)


def kernels_speed() -> None:
    import triton.testing

    from lazarus.trainer import kernels
    from lazarus.trainer.models import apply_rope_ref, cross_entropy_ref, rms_norm_ref, swiglu_ref

    bf16 = torch.bfloat16
    angles = torch.randn(2048, 32, device="cuda")
    cos, sin = angles.cos(), angles.sin()
    cases = {
        "rms_norm [8,2048,2048]": (lambda x, w: kernels.rms_norm(x, w, 1e-5),
                                   lambda x, w: rms_norm_ref(x, w, 1e-5),
                                   [torch.randn(8, 2048, 2048, device="cuda", dtype=bf16),
                                    torch.ones(2048, device="cuda", dtype=bf16)]),
        "swiglu [8,2048,8192]": (kernels.swiglu, swiglu_ref,
                                 [torch.randn(8, 2048, 8192, device="cuda", dtype=bf16),
                                  torch.randn(8, 2048, 8192, device="cuda", dtype=bf16)]),
        "rope [8,2048,32,64]": (lambda x: kernels.apply_rope(x, cos, sin),
                                lambda x: apply_rope_ref(x, cos, sin),
                                [torch.randn(8, 2048, 32, 64, device="cuda", dtype=bf16)]),
        "cross_entropy [4,2048,128256]": (
            kernels.cross_entropy, cross_entropy_ref,
            [torch.randn(4, 2048, 128256, device="cuda", dtype=bf16),
             torch.randint(0, 128256, (4, 2048), device="cuda")]),
    }
    for name, (fused, eager, inputs) in cases.items():
        times = {}
        for label, fn in (("fused", fused), ("eager", eager),
                          ("compile", torch.compile(eager, dynamic=False))):
            leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]

            def step():
                out = fn(*leaves)
                out.float().sum().backward()

            try:
                times[label] = triton.testing.do_bench(step, warmup=50, rep=200,
                                                       return_mode="median")
            except Exception as e:  # a compile failure is a figure too, not the end of the run
                print(f"{name} {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        parts = " ".join(f"{k} {v:.3f} ms" for k, v in times.items())
        ratio = (f" | eager/fused {times['eager'] / times['fused']:.2f}x"
                 + (f", compile/fused {times['compile'] / times['fused']:.2f}x"
                    if "compile" in times else "")) if "fused" in times and "eager" in times else ""
        row(f"kernel fwd+bwd {name}", parts + ratio)


def trainer_run(out: Path, *, fused: bool, steps: int, seq_len: int, batch: int,
                deterministic: bool = False) -> dict:
    label = ("fused" if fused else "eager") + (" deterministic" if deterministic else "")
    metrics = out / f"metrics-1b-{label.replace(' ', '-')}.jsonl"
    cmd = [sys.executable, "-m", "lazarus.cli", "train", "--nproc", "1", "--model", "1b",
           "--seq-len", str(seq_len), "--global-batch", str(batch), "--steps", str(steps),
           "--warmup-steps", "2", "--metrics", str(metrics),
           *(["--fused-kernels"] if fused else []),
           *(["--deterministic"] if deterministic else [])]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env={**os.environ, "LAZARUS_DEVICE": "cuda"},
                              capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        row(f"trainer 1b {label}", "FAILED: over 150 s")
        (out / f"train-1b-{label.replace(' ', '-')}.log").write_text(
            (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"))
        return {}
    (out / f"train-1b-{label.replace(' ', '-')}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        row(f"trainer 1b {label}",
            f"FAILED exit {proc.returncode}: {(proc.stderr or proc.stdout)[-400:]}")
        return {}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = [r for r in rows if "loss" in r][2:]  # the first steps compile and warm up
    tps = statistics.median(r["tokens"] / r["step_time_s"] for r in steady)
    mfu = statistics.median(r.get("mfu", float("nan")) for r in steady)
    peak = max(r.get("peak_mem_gib", float("nan")) for r in steady)
    row(f"trainer 1b seq {seq_len} batch {batch} {label}",
        f"{tps:,.0f} tok/s | MFU {100 * mfu:.1f}% | peak mem {peak:.1f} GiB "
        f"| run {time.perf_counter() - t0:.0f} s")
    return {"tokens_per_s": tps, "mfu": mfu, "peak_gib": peak}


def rank_starts(out: Path, *, repeats: int = 3) -> None:
    """`lazarus train` with its ranks forked from the launcher (which imported torch and the
    trainer without the CUDA driver) against cold ranks, on the same tiny CUDA job: whole-run
    wall time, alternating, medians. Cold is forced the documented way: torch imported before
    the launcher runs (lazarus.trainer.forkranks)."""
    verdict = subprocess.run(
        [sys.executable, "-c", "from lazarus.trainer.zygote import import_for_fork; "
                               "print(import_for_fork())"],
        env={**os.environ, "LAZARUS_DEVICE": "cuda"}, capture_output=True, text=True, timeout=120)
    row("fork-safe after import_for_fork on this card", (verdict.stdout.strip() or "?")
        + (f" (exit {verdict.returncode}: {verdict.stderr[-200:]})" if verdict.returncode else ""))
    args = ["train", "--nproc", "1", "--model", "tiny", "--steps", "3", "--seq-len", "128",
            "--global-batch", "4"]
    how = {"forked": [sys.executable, "-m", "lazarus.cli", *args],
           "cold": [sys.executable, "-c", "import sys, torch; from lazarus.cli import main; "
                                          f"sys.exit(main({args!r}))"]}
    walls: dict[str, list[float]] = {k: [] for k in how}
    for i in range(repeats):
        for label, cmd in how.items():
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env={**os.environ, "LAZARUS_DEVICE": "cuda"},
                                  capture_output=True, text=True, timeout=150)
            walls[label].append(time.perf_counter() - t0)
            (out / f"starts-{label}-{i}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                row(f"lazarus train tiny on CUDA, {label}",
                    f"FAILED exit {proc.returncode}: {(proc.stderr or proc.stdout)[-400:]}")
                return
    forked, cold = statistics.median(walls["forked"]), statistics.median(walls["cold"])
    row("lazarus train tiny, 1 rank on CUDA, 3 steps (whole run)",
        f"forked {forked:.1f} s | cold {cold:.1f} s | {cold / forked:.2f}x "
        f"(medians of {repeats}: "
        + ", ".join(f"{k} " + "/".join(f"{w:.1f}" for w in v) for k, v in walls.items()) + ")")


def plain_loop(*, steps: int, seq_len: int, batch: int) -> float:
    """The same model in a loop a user might write: bf16 autocast, fused AdamW, no FSDP."""
    from lazarus.core.flops import flops_per_token, peak_tflops
    from lazarus.trainer.models import Transformer, get_model_config
    from lazarus.trainer.snapshot import ShardCopier

    cfg = get_model_config("1b")
    model = Transformer(cfg).to_empty(device="cuda")
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 256, (batch, seq_len + 1), device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = model.loss(logits, tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    tps = batch * seq_len / statistics.median(times[2:])
    peak = peak_tflops(torch.cuda.get_device_name())
    mfu = tps * flops_per_token(cfg, seq_len) / (peak * 1e12) if peak else float("nan")
    row(f"plain eager loop 1b seq {seq_len} batch {batch} (autocast)",
        f"{tps:,.0f} tok/s | MFU {100 * mfu:.1f}% | peak mem "
        f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

    # Tier 0: the snapshot's copy of this rank's shard (model + optimizer) into host memory,
    # against one pinned device-to-host copy of the same number of bytes.
    copier = ShardCopier()
    tensors, _ = copier.capture(model, opt)  # first: allocates the pinned buffers
    stalls = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tensors, _ = copier.capture(model, opt, into=tensors)
        stalls.append(time.perf_counter() - t0)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copies = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    stall, copy = statistics.median(stalls), statistics.median(copies)
    row(f"tier-0 stall, {nbytes / 2**30:.1f} GiB shard ({len(tensors)} tensors)",
        f"{stall:.3f} s vs pinned D2H {copy:.3f} s ({nbytes / copy / 1e9:.0f} GB/s): "
        f"{stall / copy:.2f}x")
    return tps


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--skip", default="",
                   help="comma-separated: kernels,trainer,deterministic,plain,starts")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    row("card", f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
                f"CUDA {torch.version.cuda}")
    if "kernels" not in skip:
        kernels_speed()
    if "starts" not in skip:
        rank_starts(args.out)
    results = {}
    if "trainer" not in skip:
        for fused in (True, False):
            results["fused" if fused else "eager"] = trainer_run(
                args.out, fused=fused, steps=args.steps, seq_len=args.seq_len, batch=args.batch)
    if "deterministic" not in skip:
        results["fused deterministic"] = det = trainer_run(
            args.out, fused=True, deterministic=True, steps=args.steps, seq_len=args.seq_len,
            batch=args.batch)
        if det and results.get("fused"):
            row("deterministic mode's cost (fused)",
                f"{results['fused']['tokens_per_s'] / det['tokens_per_s']:.2f}x the step time")
    if "plain" not in skip:
        plain = plain_loop(steps=args.steps, seq_len=args.seq_len, batch=args.batch)
        for label, r in results.items():
            if r:
                row(f"trainer {label} / plain loop", f"{r['tokens_per_s'] / plain:.2f}x tok/s")
    (args.out / "figures.txt").write_text("".join(f"{w:<58} {v}\n" for w, v in TABLE))
    print("\n=== figures ===")
    for what, value in TABLE:
        print(f"{what:<58} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
