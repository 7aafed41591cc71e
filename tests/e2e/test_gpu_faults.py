"""GPU faults end to end on the simulated NVML backend: a degraded GPU is swapped out at a
checkpoint before it fails; a failed GPU's node is cordoned and replaced at once. Both keep
the loss curve bit for bit (same mesh throughout)."""

from __future__ import annotations


from tests.e2e.helpers import reference, train_table
from tests.e2e.test_recovery import run_up


def test_degraded_gpu_planned_swap_and_failed_gpu_replacement(tmp_path):
    steps = 36
    summary, got = run_up(tmp_path, "--nodes", "2", "--spares", "2", "--steps", str(steps),
                          "--chaos", "gpu-ecc@8:n1,gpu-xid@22:n2")
    assert summary["final_state"] == "SUCCEEDED", summary
    ecc, xid = summary["recoveries"]
    assert (ecc["detected_as"], ecc["culprit"]) == ("gpu_degraded", "n1")
    assert (xid["detected_as"], xid["culprit"]) == ("gpu_failed", "n2")
    log = "".join((tmp_path / "up" / f"daemon-{i}.log").read_text() for i in (0, 1))
    assert "drain n1 after checkpoint step" in log       # planned: through a checkpoint
    assert "promote n3" in log                           # the failed node's replacement
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert got == ref
