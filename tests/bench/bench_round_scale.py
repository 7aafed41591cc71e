"""How a recovery's cost grows with the world (on demand):
`pytest tests/bench/bench_round_scale.py -m bench -s` (BENCH_WORLDS=2,4,8,16 for the ranks,
BENCH_STORE_RANKS=1024,4096,16384 for the store; docs/scale.md reads the figures).

Two parts, each on one clock from the fault's injection:

1. **Recoveries with real ranks**: `lazarus up` (gloo, the tiny model, tier 0 every step, a
   checkpoint every 10) on W ranks -- 2 ranks a node, 2 to W/2 nodes -- and one rank
   SIGKILLed at step 20. For each W: the fault -> detection -> the next round committed ->
   each survivor's start (handover, rendezvous, build, restore, setup: lazarus.trainer.train
   .StartTimes) -> the first step; and what does not depend on this machine's speed or load
   (other work shares its cores): per survivor, the CPU-seconds its process spent, the TCP
   connections it opened and the requests it sent to the store, to its setup's end and
   through its first step (lazarus.trainer.startcost, from its rank log); the TCP
   connections the ranks held at most; the ranks that restarted in place. A world listed
   more than once (BENCH_WORLDS=2,8,2,8,2,8) is run as often, and compared at its median
   run: the spread. A survivor's hand-over is split from its rank log (when it saw the peer
   gone, let its round go, got the assignment).
2. **The round's store under N simulated ranks** (tests/bench/storeload.py: a rank's
   rendezvous operations, N client connections from 8 processes), in a network namespace of
   its own when this process may make one: the store resolves every connection's peer name
   on its one loop thread (docs/scale.md), and a DNS answer lost here costs that thread 5 s.

The survivors' part is counted as issue 40 counts it: from the assignment to their setup's
end, less what they waited at the world's collectives on the new rank's own start (the
crash's cost, not theirs: lazarus.trainer.train.StartTimes.entering dates each rank's
entering); the wall figure with those waits is printed beside it. The sizes are compared at
the same recovery: runs whose survivors kept their state where both sizes have one (a kill
that lands before the victim's newest snapshot is whole sends every survivor a step back, to
load its own snapshot of the step before: more work, and likelier the busier the cores).

Nothing asserts a time. The last line is the issue's summary:
`scale: ranks=.. survivors_x=.. store_16k_s=.. predicted_16384x8_crash_s=.. predicted_16384x8_node_s=..
replica_16384x8_crash_s=.. replica_16384x8_node_s=..` with the predictions of the model in
tests/bench/scalemodel.py: a whole-world round's, then replica mode's (docs/replicas.md) failed
replica back, BENCH_REPLICA_GPUS (512) a replica; the line before it, the rest of replica
mode's at 16,384 x 8.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from lazarus.sim import up
from tests.bench import scalemodel

pytestmark = pytest.mark.bench

WORLDS = [int(w) for w in os.environ.get("BENCH_WORLDS", "2,4,8").split(",")]
STORE_RANKS = [int(n) for n in os.environ.get("BENCH_STORE_RANKS", "1024,4096,16384").split(",")]
STORE_PROCS = 8
# The replica size the replica-mode predictions are printed for (docs/scale.md).
REPLICA_GPUS = int(os.environ.get("BENCH_REPLICA_GPUS", "512"))
FAULT_AT = 20
START = re.compile(r"round (\d+) from (.+?) at step (\d+)( in place)?.*?: first step done "
                   r"([\d.]+) s after the assignment \(handover ([\d.]+) s, rendezvous ([\d.]+) "
                   r"s, build ([\d.]+) s, restore ([\d.]+) s, setup ([\d.]+) s, first step "
                   r"([\d.]+) s\)")
# the wall-clock times the rank entered a collective of the whole world (StartTimes.entering)
ENTERED = re.compile(r"; world collectives entered at ([\d., ]+)(;|$)")
# a survivor's hand-over, split (lazarus.trainer.train.StartTimes.survived): the agent issued
# the round, the survivor had let its last round go, the assignment reached it
HANDED = re.compile(r"; handed over: a peer seen gone at ([\d.]+), issued at ([\d.]+), the last "
                    r"round let go at ([\d.]+), the assignment came at ([\d.]+)")
# lazarus.trainer.startcost: what the start cost the rank's process, to setup (a survivor's
# part) and through the first step
_COUNTS = r"([\d.]+) CPU-s, (\d+) TCP connections opened, (\d+) store requests"
COST = re.compile(rf"rank (\d+) round (\d+): the start cost this process {_COUNTS} to setup; "
                  rf"{_COUNTS} through the first step")


def _ranks() -> list[psutil.Process]:
    """This process's rank processes: workers (parked ones too) below the agents."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = p.cmdline()
            # a rank forked by the zygote carries the zygote's command line
            if "worker" in cmd and ("--zygote" not in cmd or "--zygote" in p.parent().cmdline()):
                out.append(p)
        except (psutil.Error, AttributeError):
            continue
    return out


class Connections(threading.Thread):
    """The most ESTABLISHED TCP connections the ranks held at once (sampled)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.most = (0, 0)  # (total, ranks holding any)

    def run(self) -> None:
        while not self.stop.wait(0.3):
            total = holding = 0
            for p in _ranks():
                try:
                    n = sum(1 for c in p.net_connections(kind="tcp") if c.status == "ESTABLISHED")
                except psutil.Error:
                    continue
                total += n
                holding += n > 0
            self.most = max(self.most, (total, holding))


def _starts(workdir: Path, round_: int) -> list[dict]:
    rows = []
    # a survivor goes on writing the log of the round it started in
    for log in (workdir / "nodes" / "logs").glob("*/round-*/rank-*.log"):
        row = None
        for line in log.read_text(errors="replace").splitlines():
            m = START.search(line)
            if m and int(m[1]) == round_:
                row = {"rank": int(log.stem.split("-")[1]), "in_place": bool(m[4]),
                       # "its own state" (kept in place) or where a rolled-back step came from
                       "source": m[2], "total": float(m[5]),
                       **dict(zip(("handover", "rendezvous", "build", "restore", "setup",
                                   "first_step"), map(float, m.groups()[5:])))}
                entered = ENTERED.search(line)
                row["entered"] = ([float(t) for t in entered[1].split(", ")]
                                  if entered else [])
                if handed := HANDED.search(line):
                    noticed, issued, left, came = map(float, handed.groups())
                    row["handover_split"] = {
                        # it saw its peer gone after the round was issued
                        "noticing": max(0.0, min(noticed, left) - issued),
                        # the survivor still letting its last round go when the round came
                        "letting_go": max(0.0, left - max(issued, noticed)),
                        # ready, waiting for the agent's message to reach it
                        "message": max(0.0, came - max(issued, left)),
                        # from the message to its start (entering the round, freeing objects)
                        "taking_it": max(0.0, row["handover"] - max(0.0, came - issued))}
                rows.append(row)
            m = COST.search(line)
            if m and int(m[2]) == round_ and row is not None:  # the same process's, after
                row.update({"cpu_s": float(m[3]), "connections": int(m[4]),
                            "store_requests": int(m[5]), "cpu_s_1st": float(m[6]),
                            "connections_1st": int(m[7]), "store_requests_1st": int(m[8])})
    return rows


def _own_part(survivor: dict, new_ranks: list[dict], phases: tuple[str, ...]) -> float:
    """A survivor's part of the recovery less its waits on the new rank's start, as the issue
    counts it (the new rank's start is the crash's own cost): at each collective of the whole
    world, the time from the survivor's entering to the last new rank's."""
    wait = 0.0
    for k, at in enumerate(survivor["entered"]):
        arrivals = [r["entered"][k] for r in new_ranks if len(r["entered"]) > k]
        if arrivals:
            wait += max(0.0, max(arrivals) - at)
    return max(0.0, sum(survivor[p] for p in phases) - wait)


def _median_run(rows: list[dict]) -> dict:
    """The run whose survivors' own part is the median of `rows` (the lower one of two)."""
    ranked = sorted(rows, key=lambda r: r["survivors_own_s"])
    return ranked[(len(ranked) - 1) // 2]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _recovery(tmp: Path, world: int) -> dict:
    nodes = max(2, world // 2)
    nproc = world // nodes
    args = up._parse(["--workdir", str(tmp), "--quiet", "--nodes", str(nodes),
                      "--nproc-per-node", str(nproc), "--spares", "0", "--model", "tiny",
                      "--steps", str(FAULT_AT + 12), "--seq-len", "64",
                      # divisible by each data-parallel degree the job may run at (lazarus
                      # up's min_nodes is nodes - 1)
                      "--global-batch",
                      str(math.lcm(*(nproc * n for n in range(max(1, nodes - 1), nodes + 1)))),
                      "--ckpt-every", "10",
                      "--memory-every", "1", "--chaos", f"kill-worker@{FAULT_AT}"])
    sampler = Connections()
    sampler.start()
    try:
        summary = up.run(args)
    finally:
        sampler.stop.set()
    assert summary["final_state"] == "SUCCEEDED", summary
    (rec,) = summary["recoveries"]
    (fault,) = summary["faults"]
    events = [json.loads(line) for line in (tmp / "events.jsonl").open()]
    injected = fault["time"]
    detected = next(e["time"] for e in events if e["kind"] == "fault_detected"
                    and e["time"] >= injected - 0.5)
    committed = next(e for e in events if e["kind"] == "round_started" and e["time"] >= detected)
    starts = _starts(tmp, committed["round"])
    survivors = [s for s in starts if s["in_place"]]
    own = ("handover", "rendezvous", "build", "restore", "setup")
    return {
        "world": world, "nodes": nodes,
        "detect_s": detected - injected,
        "decide_s": committed["time"] - detected,
        # the survivors' part: from the round's assignment to their own state ready; their
        # first step waits on the restarted rank, whose start is the crash's own cost
        "survivors_s": max((sum(s[p] for p in own) for s in survivors), default=float("nan")),
        # the same, less what they waited at the world's collectives on the new rank's start
        "survivors_own_s": max((_own_part(s, [r for r in starts if not r["in_place"]], own)
                                for s in survivors), default=float("nan")),
        "survivor_rendezvous_s": max((s["rendezvous"] for s in survivors), default=float("nan")),
        # where their wall time went: with a few hundredths of a CPU-second each, waiting
        "survivor_phases_s": {p: max((s[p] for s in survivors), default=float("nan"))
                              for p in own},
        # the slowest survivor's hand-over, split (lazarus.trainer.train.StartTimes.survived)
        "survivor_handover_split_s": max(
            (s["handover_split"] for s in survivors if "handover_split" in s),
            key=lambda h: sum(h.values()), default={}),
        "new_rank_s": max((s["total"] for s in starts if not s["in_place"]), default=float("nan")),
        "first_step_s": max((s["first_step"] for s in starts), default=float("nan")),
        "recovered_s": rec["recovered_after_s"],
        "in_place": len(survivors), "ranks_started": len(starts),
        # Whether the survivors went on in their own state, or went back a step: the crash
        # struck before the victim's newest snapshot was whole, and each survivor loaded its
        # own of the step before (lazarus.daemon.tier0). Which one a run meets depends on
        # where in the snapshot's write the kill lands, which the load here moves.
        "survivors_kept": bool(survivors) and all(s["source"] == "its own state"
                                                   for s in survivors),
        # per survivor, what does not depend on this machine's speed or load
        **{f"survivor_{k}": _mean([s[k] for s in survivors if k in s])
           for k in ("cpu_s", "connections", "store_requests", "cpu_s_1st", "connections_1st",
                     "store_requests_1st")},
        "survivor_cpu_s_max": max((s["cpu_s"] for s in survivors if "cpu_s" in s),
                                  default=float("nan")),
        # The least wall the survivors' own part can take here: their CPU to setup, together,
        # on this machine's cores (each survivor of a real cluster has cores of its own).
        "survivors_cpu_floor_s": sum(s.get("cpu_s", 0.0) for s in survivors)
        / (os.cpu_count() or 1),
        "load": os.getloadavg(),
        "connections": sampler.most[0], "ranks_connected": sampler.most[1],
    }


def _store(n: int, netns: bool, *, ids: bool = False) -> dict:
    """N simulated ranks' rendezvous on one store (tests/bench/storeload.py); with `ids`,
    their reads of one scalable NCCL communicator's unique ids instead."""
    driver = Path(__file__).with_name("storeload_driver.py")
    cmd = [sys.executable, str(driver), str(n), str(STORE_PROCS), *(["ids"] if ids else [])]
    if netns:
        cmd = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                         cwd=Path(__file__).parents[2])
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(line)


def _may_unshare() -> bool:
    return (os.geteuid() == 0 and shutil.which("unshare") is not None
            and subprocess.run(["unshare", "--net", "true"]).returncode == 0)


@pytest.mark.timeout(7200)
def test_recovery_cost_against_world_size(tmp_path):
    rows = []
    for i, w in enumerate(WORLDS):  # a world may be listed twice: its spread
        row = _recovery(tmp_path / f"w{w}-{i}", w)
        rows.append(row)
        print(f"\nworld {w:>3} ({row['nodes']} nodes): detect {row['detect_s']:.2f} s, decide "
              f"{row['decide_s']:.2f} s, survivors {row['survivors_s']:.2f} s (of it their own "
              f"{row['survivors_own_s']:.2f} s; rendezvous "
              f"{row['survivor_rendezvous_s']:.2f} s), new rank {row['new_rank_s']:.2f} s, "
              f"first step {row['first_step_s']:.2f} s, recovered {row['recovered_s']:.2f} s; "
              f"{row['in_place']} of {row['ranks_started']} ranks in place; "
              f"{row['connections']} TCP connections across {row['ranks_connected']} ranks",
              flush=True)
        print(f"  per survivor, to setup: {row['survivor_cpu_s']:.3f} CPU-s (max "
              f"{row['survivor_cpu_s_max']:.3f}), {row['survivor_connections']:.1f} connections "
              f"opened, {row['survivor_store_requests']:.1f} store requests; through the first "
              f"step: {row['survivor_cpu_s_1st']:.3f} CPU-s, "
              f"{row['survivor_connections_1st']:.1f} connections, "
              f"{row['survivor_store_requests_1st']:.1f} store requests; load average "
              f"{row['load'][0]:.2f} on {os.cpu_count()} cores; the survivors' CPU on "
              f"them {row['survivors_cpu_floor_s']:.3f} s", flush=True)
    netns = _may_unshare()
    stores = []
    for n in STORE_RANKS:
        s = _store(n, netns)
        stores.append(s)
        print(f"store: {n} ranks' rendezvous in {s['wall_s']:.2f} s "
              f"({s['wall_s'] / n * 1e3:.3f} ms a rank; the store's loop thread busy "
              f"{s['server_cpu_s']:.2f} s){'' if netns else ' WITH DNS in the path'}", flush=True)
    id_loads = []
    for n in STORE_RANKS:
        s = _store(n, netns, ids=True)
        id_loads.append(s)
        print(f"store: {n} ranks read one NCCL communicator's {math.ceil(n / 128)} unique ids "
              f"({s['bytes_read'] / 1e6:.1f} MB) in {s['wall_s']:.2f} s (its loop thread busy "
              f"{s['server_cpu_s']:.2f} s){'' if netns else ' WITH DNS in the path'}", flush=True)
    # A world listed more than once (BENCH_WORLDS=2,8,2,8,2,8) is taken at its median run:
    # a survivor's part is hundredths of a second, which one busy moment of 2 cores doubles.
    # The same recovery at both sizes: survivors that kept their state, where both sizes have
    # such a run (a run that went back a step adds every survivor's load of its snapshot).
    sizes = (min(WORLDS), max(WORLDS))
    kept = {w: [r for r in rows if r["world"] == w and r["survivors_kept"]] for w in sizes}
    alike = all(kept.values())
    smallest, biggest = (_median_run(kept[w] if alike else [r for r in rows if r["world"] == w])
                         for w in sizes)
    base, own_base = smallest["survivors_s"], smallest["survivors_own_s"]
    # The store's own cost is its loop thread's: the wall here is bound by the 16,384
    # simulated clients sharing this machine's cores with it.
    fit = scalemodel.fit_store([(s["ranks"], s["server_cpu_s"]) for s in stores])
    ids = scalemodel.fit_ids([(s["ranks"], s["bytes_read"], s["server_cpu_s"]) for s in id_loads])
    store_16k = fit(16384)
    crash = scalemodel.predict(16384 * 8, kind="worker_crash", store=fit, ids=ids)
    node = scalemodel.predict(16384 * 8, kind="node_lost", store=fit, ids=ids)
    print(json.dumps({"rows": rows, "stores": stores, "ids": id_loads}, indent=1))
    print(scalemodel.table(fit, ids))
    # replica mode (docs/replicas.md): only the failed replica restarts
    print(scalemodel.replica_table(fit, REPLICA_GPUS, ids))
    print(scalemodel.replica_sizes_table(fit, ids=ids))
    print("survivors in place: " + ", ".join(f"{r['in_place']} of {r['world']} at {r['world']}"
                                             for r in rows))
    first = smallest
    print(f"survivors' own part, each run: " + ", ".join(
        f"{r['survivors_own_s']:.3f} s at {r['world']}"
        f"{'' if r['survivors_kept'] else ' (back a step)'}" for r in rows))
    print("compared: " + ("runs whose survivors kept their state, at both sizes" if alike else
                          "every run (a size had no run whose survivors kept their state): a "
                          "run that went back a step is not the same recovery"))
    print(f"per survivor at {biggest['world']} ranks against {first['world']} (median runs), "
          f"to setup: "
          + ", ".join(f"{k} x{biggest['survivor_' + k] / first['survivor_' + k]:.2f}"
                      for k in ("cpu_s", "connections", "store_requests")
                      if first.get("survivor_" + k))
          + f"; wall x{biggest['survivors_s'] / base:.2f} ({biggest['survivors_s']:.2f} s "
          f"against {base:.2f} s), their own part (less the waits on the new rank) "
          f"x{biggest['survivors_own_s'] / own_base:.2f} ({biggest['survivors_own_s']:.3f} s "
          f"against {own_base:.3f} s)"
          f" with load average {biggest['load'][0]:.1f} on {os.cpu_count()} cores, where "
          f"the survivors' CPU alone takes {biggest['survivors_cpu_floor_s']:.3f} s against "
          f"{first['survivors_cpu_floor_s']:.3f} s")
    rc, rn = (scalemodel.predict_replica(16384 * 8, kind=k, store=fit,
                                         replica_gpus=REPLICA_GPUS, ids=ids)
              for k in ("worker_crash", "node_lost"))
    print(f"replica mode, {REPLICA_GPUS} GPUs a replica, at 16384x8: crash: live replicas "
          f"again {rc.stall.total:.1f} s, failed one back {rc.back.total:.1f} s; node lost: "
          f"{rn.stall.total:.1f} s, {rn.back.total:.1f} s; quorum every step "
          f"{rc.quorum_s:.2f} s")
    survivors_x = biggest["survivors_own_s"] / own_base
    print(f"scale: ranks={biggest['world']} survivors_x={survivors_x:.2f} "
          f"store_16k_s={store_16k:.2f} predicted_16384x8_crash_s={crash.total:.1f} "
          f"predicted_16384x8_node_s={node.total:.1f} "
          # replica mode at the same size (the model): the failed replica back
          f"replica_16384x8_crash_s={rc.back.total:.1f} replica_16384x8_node_s={rn.back.total:.1f}")
