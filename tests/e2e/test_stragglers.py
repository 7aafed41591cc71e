"""A slow node end to end: the daemon names the straggler from the ranks' own compute time
(every rank's wall step time is the same in synchronous training), swaps it for the idle
spare at a checkpoint because the swap pays, and the loss curve stays on the reference bit for
bit (same mesh throughout; a slower machine computes the same numbers)."""

from __future__ import annotations

import json


from tests.e2e.helpers import reference, train_table
from tests.e2e.test_recovery import run_up


def test_slow_node_is_flagged_and_swapped_for_the_spare(tmp_path):
    # Time for the detector to judge with steps left to save: a window is 20 samples of at
    # least 0.25 s (core/throughput.py), ~100 of these steps; the reference is shared.
    steps = 160
    summary, got = run_up(tmp_path, "--nodes", "2", "--spares", "1", "--steps", str(steps),
                          "--chaos", "slow-rank@6:n1", "--policy", "swap_cost_s=0.1")
    assert summary["final_state"] == "SUCCEEDED", summary
    (slow,) = summary["recoveries"]
    assert (slow["detected_as"], slow["culprit"]) == ("straggler", "n1")
    events = [json.loads(line) for line in (tmp_path / "up" / "events.jsonl").open()]
    flagged = [e for e in events if e["kind"] == "straggler"]
    # The slow node is named first, and it is the only node swapped (the rounds below). A
    # healthy node may still be named later, kept for want of a spare: compute time on two
    # shared cores is noisy and rank 0 works more than its peers (a known false alarm that
    # the detector work of issue 13 removes; until then it costs a log line, not a recovery).
    assert flagged[0]["fields"]["culprit"] == "n1"
    assert all(e["fields"].get("swap_to") is None for e in flagged[1:])
    # 2x slower, seen as 1.4-2x: on two shared cores the slow rank's burning slows its peer
    assert flagged[0]["fields"]["swap_to"] == "n2" and flagged[0]["fields"]["ratio"] > 1.3
    rounds = [e["fields"]["members"] for e in events if e["kind"] == "round_started"]
    assert rounds == [["n0", "n1"], ["n0", "n2"]]
    log = "".join((tmp_path / "up" / f"daemon-{i}.log").read_text() for i in (0, 1))
    assert "drain n1 after checkpoint step" in log        # planned: through a checkpoint
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert got == ref
