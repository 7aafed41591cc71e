"""Loss spikes end to end: a poisoned batch is skipped by the trainer; a diverging stretch of
data makes spikes repeat, the daemon rolls back to the last GOOD checkpoint (not one taken
just before the trouble), skips the bad window, and the run finishes on the trajectory of a
run that never saw that window."""

from __future__ import annotations

import json


from tests.e2e.helpers import reference, train_table
from tests.e2e.test_recovery import run_up


def test_spike_skipped_divergence_rolled_back_onto_the_reference(tmp_path):
    steps = 44
    summary, got = run_up(tmp_path, "--nodes", "2", "--spares", "0", "--steps", str(steps),
                          "--chaos", "loss-spike@20,diverge@30")
    assert summary["final_state"] == "SUCCEEDED", summary
    assert 20 in summary["skipped_steps"]
    events = [json.loads(line) for line in
              (tmp_path / "up" / "events.jsonl").read_text().splitlines()]
    rollbacks = [e["fields"] for e in events if e["kind"] == "fault_detected"]
    assert rollbacks and all(f["kind"] == "loss_spike" for f in rollbacks)
    for f in rollbacks:
        # good = no spike within good_after_steps (10) after it: never one just before
        assert f["restore_step"] <= min(f["spike_steps"]) - 10
    # A poisoned stretch may outlast what the run had read when the daemon acted: then the
    # spikes repeat and a second rollback skips the rest. The run ends on the trajectory of
    # one that skipped every window from the start.
    restore = rollbacks[-1]["restore_step"]
    windows = [f["skip_window"] for f in rollbacks]
    ref = reference(tmp_path / "ref", train_table(steps, data={"skip_windows": windows}),
                    faults=("loss-spike@20", "diverge@30"), nproc=2, dp=2, tp=1)
    for step in range(restore + 1, steps + 1):
        assert got[step] == ref[step], step
