"""Replica groups benchmark (on demand): `pytest tests/bench/bench_replicas.py -m bench -s`.

Issue 41's measure, on this machine: 4 nodes + 1 spare (one rank each), 2 replicas of 2
nodes, gloo, the tiny and small models. For each model, three real `lazarus up` runs:
  - replicas, no fault: the reference loss curve;
  - replicas, a node of replica 1 SIGKILLed (kill-node@FAULT_AT:n3): the healthy replica's
    steps (rank 0's metrics rows, their wall times), when replica 1 is back in the
    cross-replica group (the quorum that took it in; the `replica_joined` event, its first
    step done, is printed beside), the steps replica 0 lost (a step done
    twice or missing), and the loss curve against the reference;
  - the same job as one world (`--replicas 1`, its default whole-world recovery from a
    checkpoint), the same fault: the same ranks' longest gap, the baseline of the first run's.
No run saves periodically (CKPT_EVERY: a save step alone is ~2x a tiny step here).
Every time is on one clock (wall time, from the fault's injection). Nothing asserts a time;
the last line is `replicas: healthy_max_step_x=<ratio> rejoin_s=<s> steps_lost=<n>
loss_rel_err=<max>` (the worst model's).

The loss tolerance: with the "drop" policy a step without replica 1 averages half the
samples (docs/replicas.md), so the curve leaves the reference's from the fault on; the
measure is the largest relative gap of the loss averaged over WINDOW steps, against the
reference's same window, which the issue's target allows up to LOSS_TOLERANCE.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from lazarus.core.stall import is_step
from lazarus.sim import up
from lazarus.sim.localcluster import LOCAL_LEASE_TTL_S

pytestmark = pytest.mark.bench

MODELS = os.environ.get("BENCH_MODELS", "tiny,small").split(",")
STEPS, FAULT_AT = 120, 40
WINDOW = 10
LOSS_TOLERANCE = 0.05
TARGET_STEP_X, TARGET_REJOIN_S = 1.5, LOCAL_LEASE_TTL_S + 5.0
# No periodic save in the runs: a save step is ~2x a step of the tiny model here by itself
# (the replica that saves writes while it steps), with or without a failure, and the measure
# is the failure's. The one-world run recovers from its tier-0 copy in memory.
CKPT_EVERY = 10 * STEPS


def _run(tmp: Path, model: str, *, replicas: int, chaos: str) -> tuple[dict, list[dict], list[dict]]:
    """(summary, rank 0's step rows, events) of one `lazarus up` run."""
    args = up._parse(["--workdir", str(tmp), "--quiet", "--nodes", "4", "--spares", "1",
                      "--replicas", str(replicas), "--model", model, "--steps", str(STEPS),
                      "--seq-len", "128", "--global-batch", "16", "--min-nodes", "4",
                      "--ckpt-every", str(CKPT_EVERY), "--chaos", chaos])
    summary = up.run(args)
    assert summary["final_state"] == "SUCCEEDED", summary
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()
            if line.strip()]
    events = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines()
              if line.strip()]
    return summary, [r for r in rows if is_step(r)], events


def _fault_time(summary: dict) -> float:
    [fault] = [f for f in summary["faults"] if f["time"] is not None]
    return fault["time"]


def _gaps(rows: list[dict]) -> list[tuple[float, float]]:
    """(wall time a step was done, seconds since the step before it was done)."""
    return [(b["time"], b["time"] - a["time"]) for a, b in zip(rows, rows[1:])]


def _longest_gap_x(rows: list[dict], fault_at: float) -> float:
    """The longest gap between two done steps from the fault on, against the median gap of
    the steps before it (the warm-up's first steps left out)."""
    gaps = _gaps(rows)
    before = [g for t, g in gaps[3:] if t < fault_at]
    after = [g for t, g in gaps if t >= fault_at]
    return max(after) / statistics.median(before)


def _back_in_group(rows: list[dict], alone: list[int]) -> float:
    """When replica 1 was back in the cross-replica group: on rank 0's clock, when the quorum
    of the first step with both replicas after the last alone was decided (its start plus its
    `quorum_s`). The `replica_joined` event comes later: the daemon says it once the
    replica's first step is done, a step (seconds, small model) and an agent pass on."""
    if not alone:
        return float("inf")
    back = next((r for r in rows if r["step"] > alone[-1] and r["replicas_in_step"] == 2), None)
    if back is None:
        return float("inf")
    return back["time"] - back["step_time_s"] + back["quorum_s"]


def _steps_lost(rows: list[dict]) -> int:
    """Steps rank 0 did twice (redone after a restore) or never did."""
    steps = [r["step"] for r in rows]
    return (len(steps) - len(set(steps))) + len(set(range(1, STEPS + 1)) - set(steps))


def _windowed(rows: list[dict]) -> dict[int, float]:
    by_step = {r["step"]: r["loss"] for r in rows}
    return {k: statistics.fmean(by_step[s] for s in range(k, k + WINDOW))
            for k in range(1, STEPS - WINDOW + 2, WINDOW)}


def _loss_rel_err(rows: list[dict], reference: list[dict]) -> float:
    got, ref = _windowed(rows), _windowed(reference)
    return max(abs(got[k] - ref[k]) / abs(ref[k]) for k in ref)


def test_a_node_loss_stops_only_its_replica(tmp_path):
    worst = {"step_x": 0.0, "rejoin_s": 0.0, "lost": 0, "loss": 0.0}
    lines = []
    for model in MODELS:
        _, reference, _ = _run(tmp_path / f"{model}-ref", model, replicas=2, chaos="none")
        summary, rows, events = _run(tmp_path / f"{model}-replicas", model, replicas=2,
                                     chaos=f"kill-node@{FAULT_AT}:n3")
        fault_at = _fault_time(summary)
        joined = [e for e in events if e["kind"] == "replica_joined" and e["time"] > fault_at]
        joined_s = joined[0]["time"] - fault_at if joined else float("inf")
        alone = [r["step"] for r in rows if r.get("replicas_in_step") == 1]
        rejoin_s = _back_in_group(rows, alone) - fault_at
        step_x = _longest_gap_x(rows, fault_at)
        lost = _steps_lost(rows)
        loss_err = _loss_rel_err(rows, reference)
        w_summary, w_rows, _ = _run(tmp_path / f"{model}-world", model, replicas=1,
                                    chaos=f"kill-node@{FAULT_AT}:n3")
        world_x = _longest_gap_x(w_rows, _fault_time(w_summary))
        lines.append(f"{model}: healthy replica's longest step {step_x:.2f}x its median "
                     f"(one world: {world_x:.2f}x), replica 1 back {rejoin_s:.1f} s after the "
                     f"fault (its first step done {joined_s:.1f} s), {len(alone)} step(s) alone ({alone[:1]}..{alone[-1:]}), "
                     f"{lost} step(s) lost (one world: {_steps_lost(w_rows)}), loss "
                     f"{loss_err:.3f} from the reference (window {WINDOW})")
        worst = {"step_x": max(worst["step_x"], step_x),
                 "rejoin_s": max(worst["rejoin_s"], rejoin_s),
                 "lost": max(worst["lost"], lost), "loss": max(worst["loss"], loss_err)}
    print()
    print("\n".join(lines))
    met = (worst["step_x"] <= TARGET_STEP_X and worst["rejoin_s"] <= TARGET_REJOIN_S
           and worst["lost"] == 0 and worst["loss"] <= LOSS_TOLERANCE)
    print(f"targets (step <= {TARGET_STEP_X}x, back within TTL + 5 = {TARGET_REJOIN_S:.0f} s, "
          f"0 lost, loss within {LOSS_TOLERANCE}): {'met' if met else 'NOT met'}")
    print(f"replicas: healthy_max_step_x={worst['step_x']:.2f} rejoin_s={worst['rejoin_s']:.1f} "
          f"steps_lost={worst['lost']} loss_rel_err={worst['loss']:.3f}")
