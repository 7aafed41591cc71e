"""Loss spikes end to end: `lazarus train` processes on gloo with injected faults.

What "the run with the poisoned batch excluded" means here, exactly. The guard rejects the
batch of step S before the optimizer step: step S updates nothing, and step S+1 reads the next
data window. A reference run with that batch's window in `skip_windows` never reads it: its
step S already trains on the next window. So the two runs apply the same updates to the same
data in the same order, the spiked run one step number later:

    spiked step k   == reference step k       for k < S
    spiked step S   :  the rejected batch (recorded, no update)
    spiked step k+1 == reference step k       for S <= k < STEPS

bit for bit (loss and gradient norm), provided the learning rate of those steps is the same,
since a skipped step still uses its place in the schedule. The runs therefore use a flat
learning rate after warmup (min_lr = lr).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.core.stall import is_step
from lazarus.core.exitcodes import INJECTED_FAULT
from lazarus.sim.trainer_faults import DIVERGE_STEPS, worker_env
from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
from lazarus.trainer.windows import window_of_step

STEPS = 20
SPIKE = 14        # loss-spike@SPIKE and diverge@SPIKE, after 13 calm steps of history
EVERY = 4         # checkpoint period
LR = 3e-3
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--micro-batch", "2",
          "--seq-len", "32", "--lr", str(LR), "--min-lr", str(LR), "--warmup-steps", "2", "--seed", "5",
          "--guard-window", "16", "--guard-min-history", "5"]
SCALE = ["--lr-scale", "0.5", "--lr-scale-steps", "6"]   # steps 1..6, across the restart at 4


def lazarus_train(args: list[str], *, faults: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`faults`: what the ranks inject (lazarus.sim.trainer_faults), e.g. "loss-spike@14"."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(worker_env(faults) if faults else {})}
    # No retry for torch's abort at exit (docs/constraints.md): ranks end without torch's
    # teardown (trainer/exitnote.finish), so one would be a regression.
    command = [sys.executable, "-m", "lazarus.cli", "train", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def train_ok(args: list[str], **kw) -> subprocess.CompletedProcess:
    result = lazarus_train(args, **kw)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def rows(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if is_step(r)]


def by_step(rows_: list[dict]) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows_}


def window(step: int) -> list[int]:
    """The data cursors step `step` reads in an uninterrupted run without skips."""
    loader = SequenceLoader(TokenDataset(ensure_corpus(), 32), seed=5, global_batch=8, dp_rank=0,
                            dp_size=1, micro_batch=8)
    return list(window_of_step(loader, step))


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    """dp2: a run with a poisoned batch at SPIKE; then the reference that leaves its window
    out, killed at step 5 (checkpoint at 4) and resumed by fresh processes."""
    tmp = tmp_path_factory.mktemp("spiked")
    dp2 = ["--nproc", "2", "--dp", "2"]
    poisoned = train_ok(COMMON + dp2 + SCALE + ["--metrics", str(tmp / "poisoned.jsonl")],
                        faults=(f"loss-spike@{SPIKE}",))
    spikes = [r["spike"] for r in rows(tmp / "poisoned.jsonl") if r.get("skipped")]
    assert len(spikes) == 1, spikes
    # The reference is told the window the spiked run recorded, as the daemon would be.
    first, last = spikes[0]["window"]
    reference = COMMON + dp2 + SCALE + ["--skip-window", f"{first}:{last}", "--ckpt-dir", str(tmp / "ckpt"),
                                        "--ckpt-every", str(EVERY), "--metrics", str(tmp / "reference.jsonl")]
    crashed = lazarus_train(reference, faults=("crash@5:0",))
    assert crashed.returncode == INJECTED_FAULT, crashed.stderr[-3000:]
    resumed = train_ok(reference + ["--resume"])
    return {"poisoned": rows(tmp / "poisoned.jsonl"), "reference": rows(tmp / "reference.jsonl"),
            "poisoned_stdout": poisoned.stdout, "resumed_stdout": resumed.stdout}


def test_poisoned_batch_is_skipped_and_recorded_with_its_window(spiked):
    lines = spiked["poisoned"]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    skipped = [r for r in lines if r.get("skipped")]
    assert [r["step"] for r in skipped] == [SPIKE]
    spike = skipped[0]["spike"]
    assert set(spike) == {"reason", "loss", "grad_norm", "window"}
    assert spike["reason"] in ("loss_spike", "grad_norm_spike")
    assert spike["window"] == window(SPIKE)
    assert (spike["loss"], spike["grad_norm"]) == (skipped[0]["loss"], skipped[0]["grad_norm"])
    # A real spike: far above the batch the next step trained on.
    loss, grad_norm = by_step(lines)[SPIKE + 1]
    assert spike["loss"] > 1.5 * loss and spike["grad_norm"] > 3 * grad_norm
    assert f"skipped: {spike['reason']}, data window {spike['window']}" in spiked["poisoned_stdout"]


def test_losses_equal_the_reference_with_that_window_excluded(spiked):
    spiked_, reference = by_step(spiked["poisoned"]), by_step(spiked["reference"])
    assert not any(r.get("skipped") for r in spiked["reference"])
    assert list(reference) == list(range(1, STEPS + 1))
    for k in range(1, STEPS):
        same_update = k if k < SPIKE else k + 1
        assert spiked_[same_update] == reference[k], (k, spiked_[same_update], reference[k])


def test_skip_windows_and_lr_scale_survive_a_restart_exactly(spiked):
    # Steps 5.. of the reference ran in fresh processes restored from step 4: they met the
    # skipped window themselves and carried on the lr-scale span begun before the restart.
    # Their equality with the uninterrupted spiked run (test above) makes that resume exact.
    out = spiked["resumed_stdout"]
    assert "resumed from" in out
    first, last = window(SPIKE)
    assert f"data window [{first}, {last}] left out (skip_windows)" in out
    lrs = [r["lr"] for r in spiked["reference"]]
    assert lrs == [LR / 4, LR / 2] + [LR / 2] * 4 + [LR] * (STEPS - 6)  # warmup, x0.5 to step 6


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """dp1: diverge@SPIKE with checkpoints every 4 steps; then the rollback the daemon orders
    (restore step 12, the last before the spikes; skip the spikes' data span); and a reference
    run that skips that span from the start."""
    tmp = tmp_path_factory.mktemp("diverged")
    common = COMMON + ["--nproc", "1", "--ckpt-dir", str(tmp / "ckpt"), "--keep-last", "10"]
    train_ok(common + ["--ckpt-every", str(EVERY), "--metrics", str(tmp / "diverged.jsonl")],
             faults=(f"diverge@{SPIKE}",))
    diverged = rows(tmp / "diverged.jsonl")
    windows = [r["spike"]["window"] for r in diverged if r.get("skipped")]
    span = f"{min(w[0] for w in windows)}:{max(w[1] for w in windows)}"
    rolled = train_ok(COMMON + ["--nproc", "1", "--skip-window", span,
                                "--resume", str(tmp / "ckpt" / "step-00000012"),
                                "--metrics", str(tmp / "rolled.jsonl")], faults=(f"diverge@{SPIKE}",))
    train_ok(COMMON + ["--nproc", "1", "--skip-window", span, "--metrics", str(tmp / "reference.jsonl")])
    return {"diverged": diverged, "rolled": rows(tmp / "rolled.jsonl"), "rolled_stdout": rolled.stdout,
            "reference": rows(tmp / "reference.jsonl"), "span": span}


def test_divergence_spikes_repeatedly_each_recorded_with_its_window(diverged):
    lines = diverged["diverged"]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    skipped = [r for r in lines if r.get("skipped")]
    assert [r["step"] for r in skipped] == list(range(SPIKE, SPIKE + DIVERGE_STEPS))
    assert [r["spike"]["window"] for r in skipped] == [window(s) for s in range(SPIKE, SPIKE + DIVERGE_STEPS)]
    # Past the poisoned span the guard lets the run go on.
    assert not any(r.get("skipped") for r in lines[SPIKE + DIVERGE_STEPS - 1:])


def test_rollback_with_the_span_skipped_is_back_on_the_reference_trajectory(diverged):
    rolled, reference = diverged["rolled"], by_step(diverged["reference"])
    assert "resumed from" in diverged["rolled_stdout"] and "left out (skip_windows)" in diverged["rolled_stdout"]
    assert [r["step"] for r in rolled] == list(range(13, STEPS + 1))
    assert not any(r.get("skipped") for r in rolled)
    assert by_step(rolled) == {k: reference[k] for k in range(13, STEPS + 1)}
    assert {k: v for k, v in by_step(diverged["diverged"]).items() if k <= 12} == \
        {k: reference[k] for k in range(1, 13)}
