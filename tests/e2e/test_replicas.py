"""Replica groups end to end (docs/replicas.md): `lazarus up --replicas 2`, two replicas of one
node x 2 ranks (FSDP inside each), a warm spare. A rank of replica 1 is SIGKILLed, later its
node: each time only replica 1 restarts -- on the same node, then on the spare -- and heals
from replica 0, which trains on through both, never restarted, every step once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lazarus.core.stall import is_step

# Steps of ~0.1 s here (seq 128, batch 16): replica 0 trains on long enough for replica 1 to
# be back after each fault, on a busy machine too (its steps slow down with the restarts).
# Replica 0 steps alone ~0.15 s a step while replica 1 is away: back after the node's loss
# 31 steps later beside three busy loops here (25 on an idle machine since its zygote
# rehearses the step); the last fault leaves it 80 steps (a run whose steps end first
# succeeds with replica 1 still healing: docs/replicas.md).
STEPS = 130


def test_a_failure_stops_only_its_replica(tmp_path):
    summary = tmp_path / "summary.json"
    workdir = tmp_path / "up"
    proc = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "up", "--workdir", str(workdir),
         "--nodes", "2", "--nproc-per-node", "2", "--replicas", "2", "--spares", "1",
         "--steps", str(STEPS), "--seq-len", "128", "--global-batch", "16", "--summary", str(summary), "--quiet", "--timeout", "600",
         # the lowest replica of a step's quorum saves (docs/replicas.md, "Checkpoints")
         "--ckpt-every", "25",
         # each on the last member (replica 1's node), once the round that answered the one
         # before runs
         "--chaos", "kill-worker@20,kill-node@50"],
        capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "2 replicas of 1 node(s)" in proc.stdout, proc.stdout[:500]
    result = json.loads(summary.read_text())
    assert result["final_state"] == "SUCCEEDED"
    got = {r["kind"]: r for r in result["recoveries"]}
    assert set(got) == {"kill-worker", "kill-node"}, result["recoveries"]
    assert got["kill-worker"]["detected_as"] == "worker_crash", got
    assert got["kill-node"]["detected_as"] == "node_lost", got
    assert {r["culprit"] for r in got.values()} == {"n1"}, got

    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    story = "\n".join(f'{e["kind"]}: {e.get("message", "")}' for e in events) + "".join(
        f"\n-- {p.relative_to(workdir)}: {p.read_text(errors='replace')[-600:]}"
        for p in sorted(workdir.glob("nodes/logs/*/round-*/rank-*.log"))[-4:])
    for kind in ("replica_left", "replica_healing", "replica_joined"):
        assert kinds.count(kind) == 2, (kind, story)
    assert all(e["fields"]["replica"] == 1 for e in events if e["kind"].startswith("replica_")), \
        [e for e in events if e["kind"].startswith("replica_")]

    # every node's zygote rehearsed the step of a rank's own world (its replica's), the
    # spare's too: the replacement's first step starts with DTensor's caches filled
    rehearsals = {p.parent.name: [json.loads(line)["result"] for line in p.read_text().splitlines()
                                  if '"rehearsal"' in line]
                  for p in workdir.glob("nodes/logs/*/zygote.log")}
    assert len(rehearsals) == 3 and all("rehearsed" in r for r in rehearsals.values()), rehearsals

    # replica 0 (n0) ran one round, never restarted; replica 1 ran on n1 twice, then on n2
    logs = {(p.parent.parent.name, p.parent.name) for p in
            workdir.glob("nodes/logs/*/round-*/rank-*.log")}
    assert {r for n, r in logs if n == "n0"} == {"round-1"}, sorted(logs)
    assert len({r for n, r in logs if n == "n1"}) == 2, sorted(logs)
    assert {n for n, _ in logs} == {"n0", "n1", "n2"}, sorted(logs)

    # rank 0 (replica 0) did every step once, in order, some of them without replica 1, and
    # the last ones with it back
    rows = [json.loads(line) for line in Path(result["metrics"]).read_text().splitlines()]
    steps = [r for r in rows if is_step(r)]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), [r["step"] for r in steps]
    assert any(r["replicas_in_step"] == 1 for r in steps), steps
    assert steps[-1]["replicas_in_step"] == 2, steps[-1]
    assert all(r["replica_policy"] == "drop" for r in steps)
    alone = [r["step"] for r in steps if r["replicas_in_step"] == 1]
    print(f"\nreplicas e2e: replica 0 stepped alone at {alone}; recoveries (detected, "
          f"recovered after, s): {[(r['kind'], r['detected_after_s'], r['recovered_after_s']) for r in result['recoveries']]}; "
          f"replica 0's median step {sorted(r['step_time_s'] for r in steps)[len(steps) // 2]:.3f} s, "
          f"longest {max(r['step_time_s'] for r in steps[5:]):.3f} s; run {result['wall_time_s']} s")

    # replica 0, carried through both faults, saved every 25 steps and the last, and each
    # save was committed (its ranks' launch round is not the current one after the faults)
    saved = [json.loads(line) for line in (workdir / "checkpoints.jsonl").read_text().splitlines()]
    assert {c["step"] for c in saved if c["good"]} >= set(range(25, STEPS, 25)) | {STEPS}, saved
