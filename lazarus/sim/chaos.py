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
timed in seconds of the run's running instead of a step -- kill-worker@20s -- for a script
that reports no steps: a clock that runs only while every member's ranks have joined the
current round and issued its setup's collectives (RunClock), so that a slow machine's imports,
a framework's setup and a recovery's restart do not count, and a fault meets a script that is
really running. A program run through a wrapper (`-- bash train.sh`) is watched from beside it
(lazarus.trainer.progwatch), which sees its joining but not its collectives: its clock starts
at joining, and its framework's setup after that counts (Accelerate's prepare() took up to 9 s
on a loaded machine: tests/e2e/test_frameworks.py strikes by hand once a checkpoint is down).
The faults the trainer injects itself (hang, loss-spike, diverge, slow-step, slow-checkpoint)
take a step only. `lazarus up` injects an item once the round
that answers the fault before it runs (or 60 s after it), and while its target cannot be hit
(a node that runs no ranks yet, no leading daemon yet) the item waits for it, for
TARGET_WAIT_S at most; one that cannot strike at all (a cordoned node's ranks, a node that is
down) is skipped, and the summary says why (`aim`).

`lazarus chaos KIND --node NODE --workdir WORKDIR` strikes a `lazarus up` cluster by hand:
its workdir holds what reaching its etcd takes (CLUSTER_FILE).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

from lazarus.agent.adopt import left_ranks
from lazarus.agent.gpu_sim import add_fault
from lazarus.core import endpoint_file
from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import EtcdAuth
from lazarus.core.records import W_RUNNING, Keys, NodeRecord, NodeStatus
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
    seconds: bool = False           # `step` is seconds of the run's running (RunClock), not a step
    skipped: str | None = None      # why it was never injected

    def due(self, step: int, running_s: float | None) -> bool:
        """Whether it strikes now: at its step, or at its time of the run's running."""
        if self.seconds:
            return running_s is not None and running_s >= self.step
        return step >= self.step

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.step}{'s' if self.seconds else ''}" + (
            f":{self.target}" if self.target else "")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "target": self.hit or self.target,
                "injected_at_step": self.fired_step, "time": self.fired_at,
                "item": self.label, "skipped": self.skipped}


# A script that reports no steps runs its loop once each node's ranks issued this many
# collectives in the round (NodeStatus.collectives): joining and a framework's setup issue a
# handful (DDP's shape check and broadcast, a barrier or two); a training loop one or more a
# step.
LOOP_COLLECTIVES = 10


def running(state: str, members: list[str], round_: int, statuses: dict) -> bool:
    """Whether the run is RUNNING with every member's ranks in its current round's loop:
    joined, and, for a script whose collectives are counted (level 0), past its setup's
    collectives. Joined alone was not enough: Accelerate set itself up for over 3 s after
    its ranks joined at a load of 13, and `kill-worker@3s` struck before its first step."""
    if state != "RUNNING" or not members:
        return False
    for n in members:
        ns = statuses.get(n)
        if ns is None or ns.round != round_ or ns.workers != W_RUNNING:
            return False
        if 0 <= ns.collectives < LOOP_COLLECTIVES:
            return False
    return True


@dataclass(slots=True)
class RunClock:
    """The clock of timed chaos items: the seconds during which every member's ranks ran the
    current round's loop (`running`). Measured from the run's first RUNNING, a fault struck a
    loaded machine's ranks while they still imported their framework, before its first
    checkpoint (tests/e2e/test_frameworks.py failed so beside a second suite)."""
    seconds: float = 0.0
    _since: float | None = None  # when the current stretch of running began

    def advance(self, now: float, running: bool) -> float | None:
        """The clock's reading at `now`; None until the run has first run with every rank
        joined."""
        if running and self._since is None:
            self._since = now
        elif not running and self._since is not None:
            self.seconds += now - self._since
            self._since = None
        if self._since is None:
            return self.seconds if self.seconds > 0 else None
        return self.seconds + now - self._since


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


FIRE, WAIT, SKIP = "fire", "wait", "skip"
# How long an item waits for a target that may yet come (a spare not promoted yet, a leader
# not elected yet) before it is skipped: a later item must not wait behind it for good.
TARGET_WAIT_S = 60.0
# Kinds that strike a node's ranks: a node that runs none cannot take them.
_RANK_KINDS = ("kill-worker", "stop-worker")


@dataclass(frozen=True, slots=True)
class Sight:
    """What a chaos item can strike now, as `lazarus up` sees its cluster."""
    members: tuple[str, ...] = ()           # the run's nodes, in order
    working: frozenset[str] = frozenset()   # nodes whose agent reports live ranks
    down: tuple[str, ...] = ()              # nodes whose agent was killed and not revived
    cordoned: frozenset[str] = frozenset()  # they take no work until an operator says so
    leader: bool = False                    # a live daemon holds the lead


@dataclass(frozen=True, slots=True)
class Aim:
    action: str                 # FIRE, WAIT or SKIP
    node: str | None = None     # the node it strikes (FIRE)
    why: str = ""               # why it does not fire now (WAIT, SKIP)


def aim(fault: Fault, sight: Sight, waited_s: float = 0.0) -> Aim:
    """Whether a due item strikes now, waits for its target, or never will. `waited_s`: how
    long it has waited so far; past TARGET_WAIT_S a wait becomes a skip. Only what can still
    change is waited for: the schedule's later items (a revive-node among them) wait behind
    this one, so nothing but the cluster itself can bring its target back."""
    def wait(why: str) -> Aim:
        if waited_s >= TARGET_WAIT_S:
            return Aim(SKIP, why=f"{why} after {TARGET_WAIT_S:.0f} s")
        return Aim(WAIT, why=why)

    if fault.kind in DISK_KINDS:
        return Aim(FIRE)
    if fault.kind == "kill-daemon":
        return Aim(FIRE) if sight.leader else wait("no daemon leads yet")
    if fault.kind == "revive-node":
        node = fault.target or (sight.down[-1] if sight.down else None)
        if node is None:
            return Aim(SKIP, why="no node is down")
        if node not in sight.down:
            return Aim(SKIP, node, f"{node} is not down")
        return Aim(FIRE, node)
    node = fault.target or (sight.members[-1] if sight.members else None)
    if node is None:
        return wait("the run has no nodes yet")
    if node in sight.down:
        return Aim(SKIP, node, f"{node} is down")
    if fault.kind in _RANK_KINDS and node not in sight.working:
        if node in sight.cordoned:
            return Aim(SKIP, node, f"{node} is cordoned: it runs no workers")
        return wait(f"{node} runs no workers")
    return Aim(FIRE, node)


# In a `lazarus up` workdir: how a process of the operator's reaches the cluster's etcd (its
# endpoint, on a port of its own, and the files of its TLS and user). Paths, no secret: the
# password stays in its own 0600 file.
CLUSTER_FILE = "etcd-client.json"


def write_cluster_access(workdir: Path, endpoint: str, auth: EtcdAuth) -> Path:
    path = Path(workdir) / CLUSTER_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"endpoint": endpoint, "user": auth.user,
                   **{k: str(Path(v).resolve()) for k, v in auth.files.items()}}, f)
    os.replace(tmp, path)
    return path


def cluster_access(workdir: Path) -> tuple[str, EtcdAuth] | None:
    """The endpoint and access of the `lazarus up` cluster in `workdir`; None when it holds
    none."""
    path = Path(workdir) / CLUSTER_FILE
    try:
        doc = json.loads(path.read_text())
        endpoint = doc["endpoint"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is unreadable ({e}); give --etcd and its flags instead") from None
    auth = EtcdAuth.load(ca=doc.get("ca"), cert=doc.get("cert"), key=doc.get("key"),
                         user=doc.get("user"), password_file=doc.get("password_file"), env={})
    return endpoint, auth


def slowdown_script(workdir: Path, node: str) -> Path:
    """Where the workers of an agent started with --workdir WORKDIR (and the simulated GPU
    backend) read their slowdown: {"factor": F} makes every rank of the node compute F times
    slower (lazarus.sim.trainer_faults.Slowdown) until the file goes."""
    return Path(workdir) / f"{node}.slowdown.json"


def inject_slowdown(workdir: Path, node: str, factor: float = SLOW_FACTOR) -> Path:
    """Slow every rank of `node` down by `factor` (1 ends the slowdown)."""
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


def default_workdir() -> Path:
    """$LAZARUS_WORKDIR, else the workdir of the `lazarus up` cluster that runs now (its
    endpoint file names it, as `lazarus status` finds its daemons), else /tmp/lazarus."""
    if os.environ.get("LAZARUS_WORKDIR"):
        return Path(os.environ["LAZARUS_WORKDIR"])
    try:
        ep = endpoint_file.read(endpoint_file.default_path())
    except UserError:
        ep = None
    if ep is not None and ep.workdir and ep.pid > 0 and psutil.pid_exists(ep.pid):
        return Path(ep.workdir)
    return Path("/tmp/lazarus")


def main(argv: list[str]) -> int:
    """`lazarus chaos KIND --node NODE`: inject one fault into a running cluster on this host."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="lazarus chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("kill-worker", "stop-worker", "kill-node", "kill-daemon", "gpu-xid",
                                    "gpu-ecc", "slow-rank", *DISK_KINDS))
    p.add_argument("--factor", type=float, default=SLOW_FACTOR,
                   help="slow-rank: how many times slower the node computes (1: back to normal)")
    p.add_argument("--node", help="target node (not for kill-daemon)")
    p.add_argument("--dir", type=Path,
                   help="disk-full/disk-free: the checkpoint dir, on a small filesystem of its own")
    settings.add_etcd_args(p, etcd_help="etcd endpoint HOST:PORT (default: the etcd of the "
                                        "`lazarus up` cluster in --workdir, else "
                                        f"${settings.ETCD_ENV}, else {settings.DEFAULT_ETCD})")
    p.set_defaults(etcd=None)
    p.add_argument("--workdir", type=Path,
                   help="`lazarus up`'s workdir, or the agents' --workdir (default: "
                        "$LAZARUS_WORKDIR, else the running `lazarus up` cluster's, else "
                        "/tmp/lazarus)")
    args = p.parse_args(argv)
    if args.workdir is None:
        args.workdir = default_workdir()
    if args.kind in DISK_KINDS:
        if args.dir is None:
            raise UserError(f"{args.kind} needs --dir (the run's checkpoint dir)")
        print(chaos_cli(args.kind, args.dir))
        return 0
    if args.kind != "kill-daemon" and not args.node:
        raise UserError(f"{args.kind} needs --node")
    up = cluster_access(args.workdir) if args.etcd is None else None
    # `lazarus up` runs its agents with --workdir WORKDIR/nodes (lazarus.sim.localcluster)
    agents_dir = args.workdir / "nodes" if up else args.workdir
    if args.kind == "slow-rank":
        if not args.factor >= 1:
            raise UserError(f"--factor must be at least 1 (1 ends a slowdown), got {args.factor}")
        path = inject_slowdown(agents_dir, args.node, args.factor)
        print(f"slow-rank on {args.node}: x{args.factor:g}, written to {path}")
        return 0
    if args.kind in GPU_FAULTS:
        path = inject_gpu_fault(agents_dir, args.node, args.kind)
        print(f"{args.kind} on {args.node}: written to {path}")
        return 0
    endpoint, auth = up or (args.etcd or os.environ.get(settings.ETCD_ENV, settings.DEFAULT_ETCD),
                            settings.etcd_auth(args))
    keys, etcd = Keys(args.root), E.Etcd(endpoint, auth=auth)
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
    except E.EtcdUnavailable as e:
        raise UserError(f"{e}; " + (f"is the `lazarus up` cluster of {args.workdir} still "
                                    "running?" if up else "is a cluster running there? For "
                                    "`lazarus up`'s, give its workdir as --workdir")) from None
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
        for rank in left_ranks(agents_dir, args.node):
            rank.kill()
            print(f"{args.kind}: killed rank pid {rank.pid}")
    return 0
