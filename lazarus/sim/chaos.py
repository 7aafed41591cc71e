"""Fault injection: a schedule of named faults, and the acts that inject them into a local
cluster. The same names serve `lazarus up --chaos` and the tests.

    kill-worker@STEP[:NODE]   SIGKILL one training rank (of NODE, else of the last member)
    stop-worker@STEP[:NODE]   SIGSTOP one training rank, for good: a rank frozen in the
                              kernel or by a debugger. Its peers wait for it in a collective;
                              the agents name it and the round restarts
    kill-node@STEP[:NODE]     SIGKILL a node's agent, then its ranks (a host lost); its lease
                              lapses
    kill-daemon@STEP          SIGKILL the leading daemon; a standby must take over
    revive-node@STEP[:NODE]   start a killed node's agent again (default: the last one
                              killed); it joins the run at the next checkpoint boundary
    gpu-xid@STEP[:NODE]       the node's (simulated) GPU 0 reports Xid 79, fell off the bus:
                              the node is cordoned and a spare takes its place at once
    gpu-ecc@STEP[:NODE]       correctable ECC errors start rising on GPU 0 (degraded): a
                              proactive checkpoint, then a planned swap at a step boundary
    hang@STEP                 the last rank stops forever at STEP, before its forward pass
                              (once per run): the agents see no progress, take every rank's
                              stacks, and the daemon names that rank's node and restarts
    slow-rank@STEP[:NODE]     every rank of NODE (default: the last member) computes twice
                              as slowly from STEP on, as a slower machine would: the daemon
                              flags the straggler and, with a spare idle and a swap that pays
                              ([policy] swap_cost_s), swaps the node out at a checkpoint
    loss-spike@STEP           a poisoned batch at STEP: the trainer guard skips it
    diverge@STEP              a poisoned data window from STEP: spikes repeat, the daemon
                              rolls back to the last good checkpoint and skips the window
    disk-full@STEP            the checkpoint dir's filesystem (a small tmpfs of its own, in a
                              private mount namespace) fills up: host monitors alert, saves
                              fail and are dropped, training goes on without checkpoints
    disk-free@STEP            the space comes back: checkpoints are committed again
    slow-step@STEP            every rank pauses 4 s in STEP's forward pass (once per run). At
                              a round's first step that is a slow warm-up, which the hang
                              detector must sit out; later it is a stall of all ranks
    slow-checkpoint@STEP      every rank pauses 4 s inside the first checkpoint save at or
                              after STEP (a slow filesystem): no hang may be reported

A schedule is a comma-separated list, e.g. "kill-worker@10,kill-node@30:n1". An item may be
timed in seconds since the run first ran instead of a step -- kill-worker@20s -- for a script
that reports no steps; the faults the trainer injects itself (hang, loss-spike, diverge,
slow-step, slow-checkpoint) take a step only. `lazarus up` injects an item once the round
that answers the fault before it runs (or 60 s after it), and while its target cannot be hit
(a node that runs no ranks, no leading daemon) the item waits for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lazarus.agent.adopt import left_ranks
from lazarus.agent.gpu_sim import add_fault
from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core.errors import UserError
from lazarus.core.records import Keys, NodeRecord, NodeStatus
from lazarus.sim.diskfault import chaos_cli

KINDS = ("kill-worker", "stop-worker", "kill-node", "kill-daemon", "revive-node", "gpu-xid", "gpu-ecc",
         "hang", "slow-rank", "loss-spike", "diverge", "disk-full", "disk-free", "slow-step",
         "slow-checkpoint")
# What a GPU fault writes into the node's simulated-GPU fault script (lazarus.agent.gpu_sim).
GPU_FAULTS = {"gpu-xid": {"gpu": 0, "fault": "xid", "code": 79},
              "gpu-ecc": {"gpu": 0, "fault": "ecc-sbe-rising", "count": 10}}
# Faults the ranks inject themselves (lazarus.sim.trainer_faults, through the trainer's phase
# hooks): at a step, or keyed on the data a step reads, so that they are reproducible and a
# rollback's skip really removes them.
TRAINER_KINDS = ("hang", "loss-spike", "diverge", "slow-step", "slow-checkpoint")
# Faults of the checkpoint filesystem, which every node of a local cluster shares: no target.
DISK_KINDS = ("disk-full", "disk-free")
# How much slower slow-rank makes a node: plainly a straggler at any sane margin.
SLOW_FACTOR = 2.0
_ITEM = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?P<unit>s?)(?::(?P<target>[A-Za-z0-9_.-]+))?$")


@dataclass(slots=True)
class Fault:
    kind: str
    step: int
    target: str | None = None
    fired_at: float | None = None   # wall time it was injected
    fired_step: int | None = None   # last completed step seen when it was injected
    hit: str | None = None          # what it hit (node, rank/pid, daemon pid)
    seconds: bool = False           # `step` is seconds since the run first ran, not a step

    def due(self, step: int, running_s: float | None) -> bool:
        """Whether it strikes now: at its step, or its time after the run first ran."""
        if self.seconds:
            return running_s is not None and running_s >= self.step
        return step >= self.step

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.step}{'s' if self.seconds else ''}" + (
            f":{self.target}" if self.target else "")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "target": self.hit or self.target,
                "injected_at_step": self.fired_step, "time": self.fired_at}


def parse_schedule(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        m = _ITEM.match(item)
        if m is None:
            raise UserError(f"--chaos item {item!r} is not KIND@STEP[:TARGET] "
                            f"(kinds: {', '.join(KINDS)})")
        if m["kind"] not in KINDS:
            raise UserError(f"--chaos: unknown fault {m['kind']!r} (kinds: {', '.join(KINDS)})")
        if m["kind"] in ("kill-daemon", *TRAINER_KINDS, *DISK_KINDS) and m["target"]:
            raise UserError(f"--chaos {item!r}: {m['kind']} takes no target")
        step = int(m["step"])
        if m["unit"] and m["kind"] in TRAINER_KINDS:
            raise UserError(f"--chaos {item!r}: the trainer injects {m['kind']} at a step, "
                            "not at a time")
        if step < 1:
            raise UserError(f"--chaos {item!r}: the step must be at least 1")
        faults.append(Fault(kind=m["kind"], step=step, target=m["target"],
                            seconds=bool(m["unit"])))
    faults.sort(key=lambda f: (f.seconds, f.step))
    full = False
    for f in faults:
        if f.kind in DISK_KINDS:
            if (f.kind == "disk-full") == full:
                raise UserError(f"--chaos {f.kind}@{f.step}: the disk is "
                                f"{'full already' if full else 'not full'} by then")
            full = not full
    return faults


def slowdown_script(workdir: Path, node: str) -> Path:
    """Where the workers of an agent started with --workdir WORKDIR (and the simulated GPU
    backend) read their slowdown: {"factor": F} makes every rank of the node compute F times
    slower (lazarus.sim.trainer_faults.Slowdown) until the file goes."""
    return Path(workdir) / f"{node}.slowdown.json"


def inject_slowdown(workdir: Path, node: str, factor: float = SLOW_FACTOR) -> Path:
    """Slow every rank of `node` down by `factor` (1 ends the slowdown)."""
    import json
    import os

    path = slowdown_script(workdir, node)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the agent's private workdir
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"factor": factor}))
    os.replace(tmp, path)  # the workers never read half a script
    return path


def gpu_fault_script(workdir: Path, node: str) -> Path:
    """Where an agent started with --workdir WORKDIR reads its simulated GPU faults."""
    return Path(workdir) / f"{node}.gpu-faults.json"


def inject_gpu_fault(workdir: Path, node: str, kind: str) -> Path:
    path = gpu_fault_script(workdir, node)
    add_fault(path, dict(GPU_FAULTS[kind]))
    return path


def main(argv: list[str]) -> int:
    """`lazarus chaos KIND --node NODE`: inject one fault into a running cluster on this host."""
    import argparse
    import json
    import os
    import signal


    p = argparse.ArgumentParser(prog="lazarus chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("kill-worker", "stop-worker", "kill-node", "kill-daemon", "gpu-xid",
                                    "gpu-ecc", "slow-rank", *DISK_KINDS))
    p.add_argument("--factor", type=float, default=SLOW_FACTOR,
                   help="slow-rank: how many times slower the node computes (1: back to normal)")
    p.add_argument("--node", help="target node (not for kill-daemon)")
    p.add_argument("--dir", type=Path,
                   help="disk-full/disk-free: the checkpoint dir, on a small filesystem of its own")
    settings.add_etcd_args(p)
    p.add_argument("--workdir", default=os.environ.get("LAZARUS_WORKDIR", "/tmp/lazarus"),
                   help="the agents' --workdir (GPU faults are written there)")
    args = p.parse_args(argv)
    if args.kind in DISK_KINDS:
        if args.dir is None:
            raise UserError(f"{args.kind} needs --dir (the run's checkpoint dir)")
        print(chaos_cli(args.kind, args.dir))
        return 0
    if args.kind != "kill-daemon" and not args.node:
        raise UserError(f"{args.kind} needs --node")
    if args.kind == "slow-rank":
        if not args.factor >= 1:
            raise UserError(f"--factor must be at least 1 (1 ends a slowdown), got {args.factor}")
        path = inject_slowdown(Path(args.workdir), args.node, args.factor)
        print(f"slow-rank on {args.node}: x{args.factor:g}, written to {path}")
        return 0
    if args.kind in GPU_FAULTS:
        path = inject_gpu_fault(Path(args.workdir), args.node, args.kind)
        print(f"{args.kind} on {args.node}: written to {path}")
        return 0
    keys, etcd = Keys(args.root), E.Etcd(args.etcd, auth=settings.etcd_auth(args))
    try:
        if args.kind == "kill-daemon":
            kv = etcd.get(keys.leader)
            pid = json.loads(kv.value)["pid"] if kv else None
        elif args.kind == "kill-node":
            kv = etcd.get(keys.node_key(args.node))
            pid = NodeRecord.from_json(kv.value).pid if kv else None
        else:
            kv = etcd.get(keys.nodestatus_key(args.node))
            pids = NodeStatus.from_json(kv.value).pids if kv else []
            pid = pids[-1] if pids else None
    finally:
        etcd.close()
    if not pid:
        raise UserError(f"{args.kind}: nothing to kill ({args.node or 'no leader'} not found)")
    sig = signal.SIGSTOP if args.kind == "stop-worker" else signal.SIGKILL
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise UserError(f"{args.kind}: pid {pid} is not running on this host") from None
    print(f"{args.kind}: {'stopped' if sig == signal.SIGSTOP else 'killed'} pid {pid}")
    if args.kind == "kill-node":  # ranks outlive their agent alone (lazarus.agent.adopt)
        for rank in left_ranks(Path(args.workdir), args.node):
            rank.kill()
            print(f"{args.kind}: killed rank pid {rank.pid}")
    return 0
