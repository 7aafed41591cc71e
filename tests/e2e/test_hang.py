"""A hung rank end to end: no collective progress -> the agents capture every rank's stacks,
the daemon names the rank the others wait for (or the one that is frozen), restarts from the
last checkpoint, and the run finishes on the reference curve. Nothing waits for a collective
timeout (the built-in trainer's process groups time out after 300 s: trainer/worker.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import time


from lazarus.core import jobspec
from lazarus.core.records import ROLE_ACTIVE
from lazarus.sim.localcluster import LocalCluster
from tests.e2e.helpers import last_step, losses, reference, train_table, wait_for
from tests.e2e.test_agent_restart import _finished
from tests.e2e.test_recovery import run_up


def _in_checkpoint(node: str):
    def pred(st):
        ns = st.node_status.get(node)
        return ns is not None and ns.round == st.status.round and ns.long_phase.get("since")
    return pred


def _freeze(pid: int) -> float:
    os.kill(pid, signal.SIGSTOP)
    return time.time()


def test_a_rank_frozen_with_sigstop_is_named_alone_at_a_step_and_inside_a_checkpoint(tmp_path):
    """The world's hang: a rank stopped (SIGSTOP: what a rank stuck in a driver call or in
    uninterruptible I/O looks like), from outside, at an ordinary step and then in the middle
    of a save. Both times the frozen rank's node alone is named, within the step and
    checkpoint allowances (adaptive: 4x the saves seen, at least --long-phase-floor), and
    the run finishes on the reference curve."""
    steps = 36
    metrics = tmp_path / "metrics.jsonl"
    with LocalCluster(tmp_path / "cluster") as cluster:
        # a floor of 4 s: one ordinary step after a save took over 2 s on a loaded machine
        cluster.agent_args = ["--hang-floor", "4", "--long-phase-floor", "8"]
        # Every rank's save at step 20 takes 4 s more (a slow filesystem, no hang at a floor
        # of 8 s): the time to freeze a rank inside it from out here.
        cluster.trainer_faults = ["slow-checkpoint@20"]
        cluster.start_etcd()
        cluster.start_daemon()
        for node in ("n0", "n1"):
            cluster.start_agent(node, nproc=1, role=ROLE_ACTIVE)
        job = jobspec.from_dict({
            "job": {"name": "e2e", "nodes": 2, "min_nodes": 2, "nproc_per_node": 1},
            "train": {**train_table(steps, checkpoint={"dir": str(cluster.workdir / "ckpt")}),
                      "metrics": str(metrics)}}, source="test")
        cluster.submit(job)
        # at an ordinary step (saves are at multiples of 4)
        st = wait_for(cluster, lambda st: st.status and st.status.state == "RUNNING"
                      and last_step(metrics) >= 9 and not _in_checkpoint("n1")(st)
                      and st, timeout=180, what="the run past step 9, outside a save")
        frozen_at = {"n1": _freeze(st.node_status["n1"].pids[0])}
        wait_for(cluster, lambda st: st.status.round == 2 and st.status.state == "RUNNING",
                 timeout=120, what="a new round after the frozen rank at a step")
        # inside the (slow) save of step 20, not the restore at the round's start
        st = wait_for(cluster, lambda st: st.status.round == 2 and last_step(metrics) >= 19
                      and _in_checkpoint("n0")(st) and st, timeout=180,
                      what="n0's rank in the save of step 20")
        frozen_at["n0"] = _freeze(st.node_status["n0"].pids[0])
        final = wait_for(cluster, _finished, timeout=300, what="the run to finish")
        events = cluster.new_events()
        # The same cluster, a second job given the first one's checkpoint dir (issue 12: it
        # trained from scratch and its retention deleted the first job's checkpoints): the
        # run fails at once, saying why, and the first job's checkpoints stay.
        kept = sorted(p.name for p in (cluster.workdir / "ckpt").glob("step-*"))
        other = jobspec.from_dict({
            "job": {"name": "e2e-2", "nodes": 2, "min_nodes": 2, "nproc_per_node": 1},
            "train": train_table(steps, checkpoint={"dir": str(cluster.workdir / "ckpt")})},
            source="test")
        cluster.submit(other)
        refused = wait_for(cluster, lambda st: st.status.job_id == other.id and _finished(st),
                           timeout=180, what="the second job to end")
        assert refused.state == "FAILED" and "belongs to job" in refused.reason, refused.reason
        assert refused.restarts == 0
        assert sorted(p.name for p in (cluster.workdir / "ckpt").glob("step-*")) == kept
    assert final.state == "SUCCEEDED", final.reason
    hangs = [e for e in events if e.kind == "fault_detected"]
    assert [(e.fields["kind"], e.fields["culprit"]) for e in hangs] == [("hang", "n1"),
                                                                      ("hang", "n0")]
    for e, node in zip(hangs, ("n1", "n0")):
        assert f"rank {0 if node == 'n0' else 1} is frozen (stopped" in e.message, e.message
        # what the culprit's agent gave its rank, and from what (4 s floor; 8 s in the save)
        assert f"; allowance on {node}: " in e.message and " s = " in e.message, e.message
        # the allowance (4 s floor; 8 s in the save), the stack capture's 3 s, the reports
        assert e.time - frozen_at[node] < 30, (node, e.time - frozen_at[node])
    # In place (docs/inplace.md): n0's rank, the frozen one's victim, was released when n1's
    # agent killed the culprit and went on in its process; frozen itself later, it started
    # anew.
    starts = [json.loads(line) for line in metrics.open() if '"kind": "start"' in line]
    assert [(s["round"], s["in_place"]) for s in starts] == [(1, False), (2, True),
                                                            (3, False)], starts
    assert starts[0]["pid"] == starts[1]["pid"] != starts[2]["pid"]
    stacks = (cluster.workdir / "nodes" / "hangs" / "round1-n1.txt").read_text()
    assert "frozen -- stopped" in stacks
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert losses(metrics) == ref


def test_slow_first_step_and_slow_checkpoint_are_no_hang_but_a_hang_still_is(tmp_path):
    """With the floor at 3 s (steps take ~0.1-0.3 s; one took over 2 s after a save on a
    loaded machine), every rank pausing 4 s in the first step and inside a checkpoint save
    must stay quiet -- DLRover's false positives -- while a real hang later in the same run
    is caught at that floor."""
    steps = 36  # the 36-step reference of test_recovery and the test above
    summary, got = run_up(tmp_path, "--nodes", "2", "--spares", "0", "--steps", str(steps),
                          "--hang-floor", "3", "--chaos",
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
    # The hung rank's collectives, from torch's flight recorder, beside its stack: every one
    # it enqueued has completed -- it is not in a collective, the others wait for it.
    (saved,) = (tmp_path / "up" / "nodes" / "hangs").glob("round*-n1.txt")
    line = next(x for x in saved.read_text().splitlines() if x.startswith("collectives"))
    enqueued, completed = re.search(r"pg 0 \(default_pg\): #(\d+)[^;]* enqueued, #(\d+) completed",
                                    line).groups()
    assert enqueued == completed and int(enqueued) > 17, line
    assert saved.with_name(f"{saved.stem}-rank1.flight.json").exists()
    ref = reference(tmp_path / "ref", train_table(steps), nproc=2, dp=2, tp=1)
    assert got == ref
