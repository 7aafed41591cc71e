"""Loss spikes end to end: `lazarus train` processes on gloo with injected faults.

What "the run with the poisoned batch excluded" means here, exactly: the guard rejects a batch
before the optimizer step and trains the *same* step on the next data window, which is what
`skip_windows` does with a window it is told about. So a run with `loss-spike@S` and a
reference run with that batch's data window in `skip_windows` train the same steps on the same
data at the same learning rates; every step line of the spiked run that was not skipped equals
the reference's line of that step, bit for bit (loss, grad norm, lr). The spiked run's one
extra line is its rejected attempt at step S.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.trainer.data import SequenceLoader, TokenDataset, ensure_corpus
from lazarus.trainer.optim import ScheduleConfig, lr_at
from lazarus.trainer.train import FAULT_EXIT_CODE
from lazarus.trainer.windows import DIVERGE_LR_FACTOR, window_of_step

STEPS = 18
SPIKE = 14        # loss-spike@SPIKE, after 13 calm steps of history
DIVERGE = 13      # diverge@DIVERGE, one step after the checkpoint at 12
EVERY = 4         # checkpoint period
LR = 3e-3
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--micro-batch", "2",
          "--seq-len", "32", "--lr", str(LR), "--warmup-steps", "2", "--seed", "5",
          "--guard-window", "16", "--guard-min-history", "5"]
SCALE = ["--lr-scale", "0.5", "--lr-scale-steps", "6"]   # steps 1..6, across the restart at 4


def lazarus_train(args: list[str], *, fail_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LAZARUS_FAIL_AT", None)
    if fail_at:
        env["LAZARUS_FAIL_AT"] = fail_at
    metrics = Path(args[args.index("--metrics") + 1])
    ckpt = Path(args[args.index("--ckpt-dir") + 1]) if "--ckpt-dir" in args else None
    metrics_before = metrics.read_text() if metrics.exists() else ""
    ckpts_before = set(ckpt.iterdir()) if ckpt is not None and ckpt.exists() else set()
    command = [sys.executable, "-m", "lazarus.cli", "train", *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if "terminate called without an active exception" in result.stderr:
        # A known gloo teardown abort (about 1 launch in 40, see FACTS.md) after the work is
        # done; one retry from the same files tells it apart from a real failure.
        print("retrying once after a gloo abort at exit")
        metrics.write_text(metrics_before)
        if ckpt is not None:
            for path in set(ckpt.iterdir()) - ckpts_before:
                shutil.rmtree(path)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return result


def rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def trained(rows_: list[dict]) -> dict[int, tuple[float, float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in rows_ if not r.get("skipped")}


def window(step: int) -> list[int]:
    """The data cursors step `step` reads in an uninterrupted run without skips."""
    loader = SequenceLoader(TokenDataset(ensure_corpus(), 32), seed=5, global_batch=8, dp_rank=0,
                            dp_size=1, micro_batch=8)
    return list(window_of_step(loader, step))


def schedule_lr(step: int) -> float:
    return lr_at(step, ScheduleConfig(schedule="cosine", lr=LR, min_lr=1e-4, warmup_steps=2, total_steps=STEPS))


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    """dp2: a run with a poisoned batch at SPIKE; then the reference that leaves its window
    out, killed at step 5 (checkpoint at 4) and resumed by fresh processes."""
    tmp = tmp_path_factory.mktemp("spiked")
    dp2 = ["--nproc", "2", "--dp", "2"]
    poisoned = lazarus_train(COMMON + dp2 + SCALE + ["--inject", f"loss-spike@{SPIKE}",
                                                     "--metrics", str(tmp / "poisoned.jsonl")])
    assert poisoned.returncode == 0, poisoned.stderr[-3000:]
    spikes = [r["spike"] for r in rows(tmp / "poisoned.jsonl") if r.get("skipped")]
    assert len(spikes) == 1, spikes
    # The reference is told the window the spiked run recorded, as the daemon would be.
    first, last = spikes[0]["window"]
    reference = COMMON + dp2 + SCALE + ["--skip-window", f"{first}:{last}", "--ckpt-dir", str(tmp / "ckpt"),
                                        "--ckpt-every", str(EVERY), "--metrics", str(tmp / "reference.jsonl")]
    crashed = lazarus_train(reference, fail_at="5:0")
    assert crashed.returncode == FAULT_EXIT_CODE, crashed.stderr[-3000:]
    resumed = lazarus_train(reference + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"poisoned": rows(tmp / "poisoned.jsonl"), "reference": rows(tmp / "reference.jsonl"),
            "poisoned_stdout": poisoned.stdout, "resumed_stdout": resumed.stdout}


def test_poisoned_batch_is_skipped_and_recorded_with_its_window(spiked):
    lines = spiked["poisoned"]
    skipped = [r for r in lines if r.get("skipped")]
    assert [r["step"] for r in skipped] == [SPIKE]
    spike = skipped[0]["spike"]
    assert spike["reason"] in ("loss_spike", "grad_norm_spike")
    assert spike["window"] == window(SPIKE) and spike["preceding"] == window(SPIKE - 1)
    assert (spike["loss"], spike["grad_norm"]) == (skipped[0]["loss"], skipped[0]["grad_norm"])
    ok = trained(lines)
    assert list(ok) == list(range(1, STEPS + 1))
    # A real spike: far above the batch trained at step SPIKE in its place.
    loss, grad_norm, _ = ok[SPIKE]
    assert spike["loss"] > 1.5 * loss and spike["grad_norm"] > 3 * grad_norm
    assert f"skipped: {spike['reason']}, data window {spike['window']}" in spiked["poisoned_stdout"]


def test_losses_equal_the_reference_with_that_window_excluded(spiked):
    reference = spiked["reference"]
    assert not any(r.get("skipped") for r in reference)
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert trained(spiked["poisoned"]) == trained(reference)  # bit for bit, every step


def test_skip_windows_and_lr_scale_survive_a_restart_exactly(spiked):
    # Steps 5.. of the reference ran in fresh processes restored from step 4: they met the
    # skipped window themselves and carried on the lr-scale span begun before the restart.
    # Equality with the uninterrupted spiked run (test above) makes that resume exact.
    out = spiked["resumed_stdout"]
    assert "resumed from" in out
    first, last = window(SPIKE)
    assert f"data window [{first}, {last}] left out (skip_windows)" in out
    lrs = {r["step"]: r["lr"] for r in spiked["reference"]}
    assert lrs == {s: schedule_lr(s) * (0.5 if s <= 6 else 1.0) for s in range(1, STEPS + 1)}


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """dp1: diverge@DIVERGE with checkpoints every 4 steps until the guard gives up; then the
    rollback the daemon orders: restore step 12, skip the window that preceded the spikes,
    half the lr for 2 steps."""
    tmp = tmp_path_factory.mktemp("diverged")
    metrics = tmp / "metrics.jsonl"
    args = COMMON + ["--nproc", "1", "--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", str(EVERY),
                     "--metrics", str(metrics)]
    blown = lazarus_train(args + ["--inject", f"diverge@{DIVERGE}", "--guard-max-skips", "3"])
    before = rows(metrics)
    spikes = [r["spike"] for r in before if r.get("skipped")]
    preceding = spikes[0]["preceding"]
    rolled = lazarus_train(args + ["--resume", str(tmp / "ckpt" / "step-00000012"), "--skip-window",
                                   f"{preceding[0]}:{preceding[1]}", "--lr-scale", "0.5", "--lr-scale-steps", "2"])
    return {"blown": blown, "before": before, "after": rows(metrics)[len(before):], "rolled": rolled}


def test_divergence_is_skipped_repeatedly_then_stops_the_run(diverged):
    blown, before = diverged["blown"], diverged["before"]
    assert blown.returncode == 2
    assert "the run diverged: the guard skipped 3 batches in a row" in blown.stderr
    assert "Traceback" not in blown.stderr
    assert [r["step"] for r in before] == list(range(1, DIVERGE + 1)) + [DIVERGE + 1] * 3
    blow_up = before[DIVERGE - 1]
    assert blow_up["lr"] == pytest.approx(schedule_lr(DIVERGE) * DIVERGE_LR_FACTOR) and "skipped" not in blow_up
    # Each rejected batch is the next data window; all follow the window of the blow-up.
    spikes = [r["spike"] for r in before[DIVERGE:]]
    assert [s["window"] for s in spikes] == [window(DIVERGE + 1 + i) for i in range(3)]
    assert all(s["preceding"] == window(DIVERGE) for s in spikes)
    assert all(s["reason"] in ("loss_spike", "grad_norm_spike", "nonfinite_loss", "nonfinite_grad_norm")
               for s in spikes)


def test_rollback_with_the_window_skipped_returns_to_normal(diverged):
    assert diverged["rolled"].returncode == 0, diverged["rolled"].stderr[-3000:]
    after, before = diverged["after"], diverged["before"]
    assert [r["step"] for r in after] == list(range(DIVERGE, STEPS + 1))
    assert not any(r.get("skipped") for r in after)
    calm = max(r["loss"] for r in before[4:DIVERGE - 1])
    assert all(r["loss"] < calm + 0.5 for r in after), [r["loss"] for r in after]
    # The lr order counts from the restore step (12): steps 13 and 14 at half the schedule.
    assert [r["lr"] for r in after] == [schedule_lr(s) * (0.5 if s <= 14 else 1.0) for s in range(DIVERGE, STEPS + 1)]
