"""A hung rank end to end: no collective progress -> the agents capture every rank's stacks,
the daemon names the rank the others wait for, restarts from the last checkpoint, and the run
finishes on the reference curve. Nothing waits for a collective timeout (600 s by default)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import reference
from tests.e2e.test_recovery import TRAIN, run_up

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
    ref = reference(tmp_path / "ref", {**TRAIN, "steps": steps, "warmup_steps": 10},
                    nproc=2, dp=2, tp=1)
    assert got == ref
