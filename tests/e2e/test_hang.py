"""A hung rank end to end: no collective progress -> the agents capture every rank's stacks,
the daemon names the rank the others wait for, restarts from the last checkpoint, and the run
finishes on the reference curve. Nothing waits for a collective timeout (600 s by default)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import reference, train_table
from tests.e2e.test_recovery import run_up

pytestmark = pytest.mark.e2e


def test_hang_is_detected_with_culprit_and_stacks_and_recovered(tmp_path):
    steps = 30
    summary, got = run_up(tmp_path, "--nodes", "2", "--spares", "0", "--steps", str(steps),
                          "--chaos", "hang@14")
    assert summary["final_state"] == "SUCCEEDED", summary
    (hang,) = summary["recoveries"]
    assert (hang["detected_as"], hang["culprit"]) == ("hang", "n1")  # rank 1 lives on n1
    # the default floor is 10 s; steps take well under a second here
    assert hang["detected_after_s"] < 60
    stacks = (tmp_path / "up" / "nodes" / "hangs" / "round1-n1.txt").read_text()
    assert "_hang_here" in stacks                       # the stuck rank's own frame
    peer = (tmp_path / "up" / "nodes" / "hangs" / "round1-n0.txt").read_text()
    assert "=== rank 0" in peer
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert got == ref


def test_slow_first_step_and_slow_checkpoint_are_no_hang_but_a_hang_still_is(tmp_path):
    """With the floor at 1 s (steps take ~0.1-0.3 s), every rank pausing 4 s in the first
    step and inside a checkpoint save must stay quiet -- DLRover's false positives -- while
    a real hang later in the same run is caught at that floor."""
    steps = 24
    summary, got = run_up(tmp_path, "--nodes", "2", "--spares", "0", "--steps", str(steps),
                          "--hang-floor", "1", "--chaos",
                          "slow-step@1,slow-checkpoint@8,hang@18")
    assert summary["final_state"] == "SUCCEEDED", summary
    ckpt = tmp_path / "up" / "checkpoints"
    assert (ckpt / ".stall-step-1").exists() and (ckpt / ".stall-checkpoint-8").exists()
    by_kind = {r["kind"]: r for r in summary["recoveries"]}
    assert by_kind["slow-step"]["detected_after_s"] is None
    assert by_kind["slow-checkpoint"]["detected_after_s"] is None
    assert (by_kind["hang"]["detected_as"], by_kind["hang"]["culprit"]) == ("hang", "n1")
    events = [json.loads(line) for line in (tmp_path / "up" / "events.jsonl").open()]
    faults = [e["fields"].get("kind") for e in events if e["kind"] == "fault_detected"]
    assert faults == ["hang"]                       # the stalls raised nothing
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert got == ref
