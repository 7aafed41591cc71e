"""`lazarus up`'s metrics tail (lazarus.sim.up.MetricsTail): which step a fault's round had
done, read from the file's order -- the summary's `last_step`, which bounds what a recovery
may restore (a kill lands a step or two after the step the injector saw)."""

from __future__ import annotations

import json

from lazarus.sim.up import MetricsTail


def _step(n: int) -> dict:
    return {"step": n, "loss": 1.0, "step_time_s": 0.05}


def test_the_last_step_before_a_round_is_read_in_the_files_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "start", "round": 1, "step": 0}, _step(1), _step(2), _step(13), _step(14),
            {"kind": "start", "round": 2, "step": 14}, _step(15), _step(16),
            # a recovery that redoes steps: the step counter goes back
            {"kind": "start", "round": 3, "step": 10}, _step(11)]
    tail = MetricsTail(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:7]))
    tail.poll()
    assert tail.last_step_before_round(2) == 14
    assert tail.last_step_before_round(1) is None      # nothing before the first round
    assert tail.last_step_before_round(3) is None      # not started (yet)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[7:]))
    tail.poll()
    assert tail.last_step_before_round(3) == 16
    assert [r["step"] for _, r in tail.seen] == [1, 2, 13, 14, 15, 16, 11]
