"""`lazarus up`: a whole local cluster -- embedded etcd, a leader daemon and a standby, N agents
as simulated nodes plus K warm spares -- runs a tiny job, injects faults on a schedule, shows
progress and recoveries live, and ends with a summary (printed, and as JSON with --summary).

With no options it is the demo: 2 nodes + 1 spare, a worker crash and a node loss, both
recovered from the last checkpoint with no human in the loop.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from lazarus.ops import report
from lazarus.ops.run import build_job, event_line, split_command
from lazarus.sim import chaos

from lazarus.sim import diskfault

from lazarus.core import endpoint_file

from lazarus.core import jobspec, jobuser, settings
from lazarus.core.consoletext import printable
from lazarus.core.errors import UserError
from lazarus.core.trainconfig import TrainConfig
from lazarus.sim.localcluster import LOCAL_LEASE_TTL_S, LocalCluster
from lazarus.core.records import ROLE_ACTIVE, ROLE_SPARE, TERMINAL
from lazarus.core.stall import is_step
from lazarus.trainer.corpus import ensure_corpus

DEMO_CHAOS = "kill-worker@12,kill-node@30"
# `lazarus up -- COMMAND`: a script of the user's own may report no steps, so its faults are
# timed in seconds of its running (chaos.RunClock).
DEMO_OWN_CHAOS = "kill-worker@15s,kill-node@35s"


class MetricsTail:
    """Follows the rank-0 metrics file; remembers when each step line was first seen (the
    checkpoint lines among them are left out)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self.latest: dict | None = None
        self.seen: list[tuple[float, dict]] = []  # (arrival wall time, record)
        self._starts: dict[int, int] = {}  # round -> step lines before rank 0's start line

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete, _, _ = chunk.rpartition("\n")
        if not complete:
            return []
        self._offset += len(complete) + 1
        now = time.time()
        out = []
        for line in complete.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("kind") == "start" \
                    and isinstance(rec.get("round"), int):
                self._starts.setdefault(rec["round"], len(self.seen))
            if not isinstance(rec, dict) or not is_step(rec):
                continue  # a checkpoint's stall line: the report reads those
            out.append(rec)
            self.seen.append((now, rec))
            self.latest = rec
        return out

    def first_step_after(self, t: float) -> tuple[float, dict] | None:
        return next(((at, rec) for at, rec in self.seen if at > t), None)

    def last_step_before_round(self, round_: int) -> int | None:
        """The newest step done before rank 0 started round `round_`, in the file's order (no
        clock: a fault's kill lands a step or two after the injector saw the step it read)."""
        n = self._starts.get(round_)
        if n is None:
            return None
        return max((rec.get("step", 0) for _, rec in self.seen[:n]), default=None)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lazarus up", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="active nodes (default %(default)s)")
    p.add_argument("--min-nodes", type=int, default=None,
                   help="smallest node count the run may shrink to (default: nodes - 1, >= 1)")
    p.add_argument("--spares", type=int, default=1, help="warm spare nodes (default %(default)s)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides nproc)")
    p.add_argument("--replicas", type=int, default=1,
                   help="replica groups of the built-in trainer (divides nodes): a failure "
                        "stops only its replica, which heals from a live one while the others "
                        "train on (docs/replicas.md); 1: whole-world recoveries (default)")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree; must equal nodes x nproc / tp (derived if omitted)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--memory-every", type=int, default=0,
                   help="a tier-0 snapshot in host memory every N steps; 0: as often as its "
                        "stall stays under 1%% of the step time; -1: none")
    p.add_argument("--chaos", default=None,
                   help=f"fault schedule, e.g. {DEMO_CHAOS!r}; 'none' for no faults "
                        f"(default: the demo's {DEMO_CHAOS!r})")
    p.add_argument("--policy", action="append", default=[], metavar="KEY=VALUE",
                   help="a [policy] setting of the job, e.g. swap_cost_s=5 (repeatable)")
    p.add_argument("--metrics", type=Path, help="per-step JSON lines (rank 0)")
    p.add_argument("--summary", type=Path, help="write the summary JSON here")
    p.add_argument("--workdir", type=Path, help="logs, checkpoints, etcd data (default: a temp dir)")
    p.add_argument("--lease-ttl", type=int, default=LOCAL_LEASE_TTL_S,
                   help="agent and daemon lease TTL, s (default %(default)s)")
    p.add_argument("--hang-k", type=float, default=None,
                   help="agents: a rank hangs after k x the median step time without progress "
                        "(default: the agent's, 3)")
    p.add_argument("--hang-floor", type=float, default=None,
                   help="agents: ... and never before this many seconds (default: the agent's, 10)")
    p.add_argument("--replica-encrypt", action="store_true",
                   help="agents: encrypt the tier-0 copies they send each other")
    p.add_argument("--run-as", metavar="USER", default=None,
                   help="agents: run the ranks as this user, not yours (as root; make one with "
                        "`bash deploy/job-user.sh USER`): the job's code then cannot read the "
                        "cluster's credentials (docs/security.md)")
    p.add_argument("--monitors", choices=("on", "off"), default="on",
                   help="agents' GPU, host, hang and throughput monitors and the workers' "
                        "progress reports; 'off' exists to measure what they cost")
    p.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    p.add_argument("--first-step-timeout", type=float, default=None,
                   help="agents: a rank with no timed steps yet (and any rank of a script that "
                        "reports none) hangs after this many seconds without a collective "
                        "(default: the agent's, 300)")
    p.add_argument("--rdzv-timeout", type=float, default=120.0,
                   help="seconds for a round's ranks to start and join their process group "
                        "(default %(default)s)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="with -- COMMAND: add to every rank's environment (repeatable)")
    p.add_argument("--cwd", default=None,
                   help="with -- COMMAND: where the ranks start (default: this directory)")
    p.add_argument("--quiet", action="store_true", help="only events and the summary")
    options, command = split_command(argv)
    args = p.parse_args(options)
    args.command = command
    if not args.rdzv_timeout > 0:  # also NaN
        raise UserError(f"--rdzv-timeout must be a positive number of seconds, "
                        f"got {args.rdzv_timeout:g}")
    return args


def _user_job(args: argparse.Namespace, command: list[str], metrics: Path) -> jobspec.JobSpec:
    """The job of `lazarus up -- COMMAND`: the user's script on the local nodes; a script that
    reports its steps (level 1) writes them where this command shows them from."""
    args.min_nodes = args.min_nodes if args.min_nodes is not None else max(1, args.nodes - 1)
    args.max_restarts, args.name = 20, None
    args.spares_ok, args.metrics_file = False, str(metrics)
    return build_job(args, command, check=True)


def _job(args: argparse.Namespace, workdir: Path, metrics: Path) -> jobspec.JobSpec:
    for name in ("nodes", "nproc_per_node", "tp", "steps", "global_batch", "seq_len"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.spares < 0:
        raise UserError("--spares must not be negative")
    settings.check_lease_ttl(args.lease_ttl)
    world = args.nodes * args.nproc_per_node
    if args.dp is not None and args.dp * args.tp != world:
        raise UserError(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} ranks, but "
                        f"{args.nodes} node(s) x {args.nproc_per_node} = {world} ranks")
    if args.replicas < 1:
        raise UserError(f"--replicas must be at least 1, got {args.replicas}")
    replicas = args.replicas > 1
    # A replica job shrinks by whole replicas only (docs/replicas.md).
    min_nodes = (args.nodes if replicas else
                 args.min_nodes if args.min_nodes is not None else max(1, args.nodes - 1))
    doc = {"job": {"name": "lazarus-up", "nodes": args.nodes, "min_nodes": min_nodes,
                   "nproc_per_node": args.nproc_per_node,
                   "rendezvous_timeout_s": args.rdzv_timeout},
           "train": {"steps": args.steps, "metrics": str(metrics),
                     "model": {"name": args.model},
                     "parallelism": {"tp": args.tp},
                     "optimizer": {"warmup_steps": min(10, args.steps)},
                     "data": {"global_batch": args.global_batch, "seq_len": args.seq_len},
                     "checkpoint": {"dir": str(workdir / "checkpoints"), "every": args.ckpt_every,
                                    "memory_every": args.memory_every}}}
    if replicas:
        doc["job"].update(failure_unit="replica", replicas=args.replicas)
        # Its replicas heal from each other: a live replica is its copy in memory, so no
        # tier 0 unless asked (and then jobspec says why not); storage is for whole-world
        # restarts (docs/replicas.md, "Checkpoints").
        if args.memory_every == 0:
            doc["train"]["checkpoint"]["memory_every"] = -1
    if args.policy:
        doc["policy"] = _policy_args(args.policy)
    return jobspec.from_dict(doc, source="lazarus up")


def _rank_faults(faults: list[chaos.Fault], world: int) -> list[str]:
    """The chaos schedule's trainer faults as the ranks inject them (lazarus.sim.trainer_faults):
    a hang strikes the last rank."""
    return [f"{f.kind}@{f.step}" + (f":{world - 1}" if f.kind == "hang" else "") for f in faults]


def _agent_args(args: argparse.Namespace) -> list[str]:
    """The `lazarus agent` flags every node gets from these options."""
    out = ["--monitors", args.monitors]
    if args.hang_k is not None:
        if not args.hang_k > 1:
            raise UserError(f"--hang-k must be above 1, got {args.hang_k:g}")
        out += ["--hang-k", repr(args.hang_k)]
    if args.first_step_timeout is not None:
        if not args.first_step_timeout > 0:
            raise UserError(f"--first-step-timeout must be positive, got {args.first_step_timeout:g}")
        out += ["--first-step-timeout", repr(args.first_step_timeout)]
    if args.hang_floor is not None:
        if not args.hang_floor > 0:
            raise UserError(f"--hang-floor must be positive, got {args.hang_floor:g}")
        out += ["--hang-floor", repr(args.hang_floor)]
    if args.replica_encrypt:
        out.append("--replica-encrypt")
    return out


def _run_as(name: str, workdir: Path, metrics: Path) -> jobuser.JobUser:
    """The user the ranks run as, given what this run has them write: the checkpoint dir,
    theirs; the metrics file, theirs; the workdir (and the metrics' directory), passable by
    them, not listable (the cluster's credentials are in it, closed to them)."""
    user = jobuser.JobUser.resolve(name)
    jobuser.check_agent_may_switch()
    user.open_to(workdir, "--workdir")  # this run's own: its group may change, not another's
    user.give(workdir / "checkpoints")
    if not user.can_pass(metrics.parent):
        raise UserError(f"--metrics {metrics}: the ranks' user {user.name} cannot reach its "
                        f"directory; give one it can (the default is in the workdir)")
    fd = os.open(metrics, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.fchown(fd, user.uid, user.gid)
    os.close(fd)
    return user


def _policy_args(items: list[str]) -> dict:
    """--policy KEY=VALUE as a [policy] table; values are TOML literals (the job file's)."""
    import tomllib

    table = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--policy {item!r} is not KEY=VALUE")
        try:
            table.update(tomllib.loads(f"{key.strip()} = {value.strip()}"))
        except tomllib.TOMLDecodeError:
            raise UserError(f"--policy {item!r}: {value.strip()!r} is not a number, "
                            "boolean or quoted string") from None
    return table


def _sight(cluster: LocalCluster, st) -> chaos.Sight:
    """What a chaos item could strike now (chaos.aim decides whether it does)."""
    live_daemons = {proc.popen.pid for proc in cluster.daemons if proc.alive}
    return chaos.Sight(
        members=tuple(st.status.members) if st.status else (),
        working=frozenset(n for n, ns in st.node_status.items() if ns.pids),
        down=tuple(n for n, proc in cluster.agents.items() if not proc.alive),
        cordoned=frozenset(st.cordoned),
        leader=st.leader_pid in live_daemons)


def _check_targets(schedule: list[chaos.Fault], nodes: list[str]) -> None:
    for f in schedule:
        if f.target is not None and f.target not in nodes:
            raise UserError(f"--chaos {f.label}: no node {f.target!r} here (the nodes are "
                            f"{', '.join(nodes)})")


# Faults the daemon answers with a new round. The next chaos item waits for that round (or
# this long): a fault slow to be seen -- a hang, a lease running out -- leaves the run RUNNING
# meanwhile, and a second fault then would strike before the first was answered.
ANSWERED_BY_A_ROUND = ("kill-worker", "stop-worker", "kill-node", "gpu-xid")
ANSWER_WAIT_S = 60.0


def _unanswered(schedule: list[chaos.Fault], events: list) -> bool:
    """Whether a fault injected awaits the round that answers it. Any of them, not only the
    last: a fault the trainer injects itself (a slow step) may come after it -- the ranks
    of a killed node's peers go on for a step or two -- and answers nothing."""
    now = time.time()
    return any(f.fired_at is not None and f.kind in ANSWERED_BY_A_ROUND
               and now - f.fired_at <= ANSWER_WAIT_S
               and not any(e.kind == "round_started" and e.time > f.fired_at for e in events)
               for f in schedule)


def _inject(cluster: LocalCluster, fault: chaos.Fault, node: str | None, step: int) -> None:
    fault.fired_at, fault.fired_step = time.time(), step
    if fault.kind == "kill-worker":
        fault.hit = cluster.kill_worker(node)
    elif fault.kind == "stop-worker":
        fault.hit = cluster.kill_worker(node, signal.SIGSTOP)
    elif fault.kind == "kill-node":
        fault.hit = cluster.kill_node(node)
    elif fault.kind in chaos.GPU_FAULTS:
        fault.hit = cluster.gpu_fault(node, fault.kind)
    elif fault.kind == "slow-rank":
        fault.hit = cluster.slow_node(node, chaos.SLOW_FACTOR)
    elif fault.kind == "revive-node":
        fault.hit = cluster.revive_node(node)
    elif fault.kind == "disk-full":
        fault.hit = cluster.fill_disk()
    elif fault.kind == "disk-free":
        fault.hit = cluster.free_disk()
    else:
        fault.hit = cluster.kill_daemon()
        cluster.start_daemon()  # a new standby, so the next leader death is covered too
        _publish_api(cluster)


def _small_checkpoint_fs(cluster: LocalCluster, job: jobspec.JobSpec,
                         args: argparse.Namespace) -> str:
    """disk-full's filesystem: room for the retained checkpoints and one in flight, and host
    monitors that fail once the next checkpoint no longer fits (their defaults, in GiB, are
    for real disks)."""
    one = diskfault.checkpoint_bytes(args.model)
    keep = TrainConfig.from_dict(job.train_config_for(args.nodes)).checkpoint.keep_last
    size = diskfault.checkpoint_fs_bytes(one, keep)
    cluster.small_checkpoint_fs(Path(job.train["checkpoint"]["dir"]), size)
    cluster.agent_args += ["--min-free-mb", f"{one / diskfault.MiB:.2f}",
                           "--low-free-mb", f"{2 * one / diskfault.MiB:.2f}"]
    return (f"checkpoint dir on a {size // diskfault.MiB} MiB tmpfs of its own (disk-full); "
            "its checkpoints go when this command ends")


def _publish_api(cluster: LocalCluster) -> None:
    """Leave the live daemons' API addresses and token where `lazarus status` looks; the
    file goes when this process exits."""
    path = endpoint_file.default_path()
    live = [a for a, proc in zip(cluster.api_addresses, cluster.daemons) if proc.alive]
    endpoint_file.write(path, endpoint_file.Endpoint(addresses=live, token=cluster.token,
                                                     pid=os.getpid(),
                                                     workdir=str(cluster.workdir)))
    atexit.register(endpoint_file.remove_if_mine, path, os.getpid())


def _seen_as(kind: str) -> str:
    """The event kind under which the daemon reports a fault of this chaos kind."""
    return {"gpu-ecc": "gpu_degraded", "slow-rank": "straggler",
            "disk-full": "host_alert"}.get(kind, "fault_detected")


# Stalls every rank sits out: they must raise nothing, so neither does one close another
# fault's window nor may it take a detection another fault explains (CI: chaos struck
# kill-node late, a slow-step fired before the loss was seen and took its detection).
QUIET_STALLS = ("slow-step", "slow-checkpoint")


def _recoveries(faults: list[chaos.Fault], events: list, tail: MetricsTail,
                leader_changes: list[tuple[float, int]]) -> list[dict]:
    by_fault = {}
    taken: set[int] = set()  # ids of detections a fault has claimed
    for f in sorted(faults, key=lambda g: g.kind in QUIET_STALLS):  # stalls claim last
        by_fault[id(f)] = _recovery(f, faults, events, tail, leader_changes, taken)
    return [by_fault[id(f)] for f in faults if by_fault[id(f)] is not None]


def _recovery(f: chaos.Fault, faults: list[chaos.Fault], events: list, tail: MetricsTail,
              leader_changes: list[tuple[float, int]], taken: set[int]) -> dict | None:
    if f.fired_at is None or f.kind in ("revive-node", "loss-spike", "disk-free"):
        return None  # a revival is no fault; a single spike is skipped by the trainer
    rec = {"kind": f.kind, "fault_step": f.fired_step, "target": f.hit,
           "detected_after_s": None, "recovered_after_s": None, "culprit": None}
    if f.kind == "kill-daemon":
        new = next((t for t, _pid in leader_changes if t > f.fired_at), None)
        if new is not None:
            rec["detected_after_s"] = rec["recovered_after_s"] = round(new - f.fired_at, 3)
            rec["culprit"] = f.hit
    else:
        # A detection belongs to this fault if it comes before the next fault that would
        # be seen the same way struck (a stall that raised nothing must not take a later
        # hang's detection as its own); a fault of another kind meanwhile -- a worker
        # killed while the disk is full -- leaves the window open.
        until = min((g.fired_at for g in faults if g.fired_at is not None
                     and g.fired_at > f.fired_at
                     and g.kind not in ("revive-node", *QUIET_STALLS)
                     and (_seen_as(g.kind) == _seen_as(f.kind)
                          or (f.kind, g.kind) == ("disk-full", "disk-free"))),
                    default=float("inf"))
        seen_as = _seen_as(f.kind)
        det = next((e for e in events if e.kind == seen_as and id(e) not in taken
                    and f.fired_at - 0.5 <= e.time < until), None)
        if det is not None:
            taken.add(id(det))
            # Counted as the daemon and the report count (docs/architecture.md, "Failure
            # classes"): from the fault's time as the control plane dates it -- a crash
            # when its agent saw the exit, a lost node one lease TTL before the loss was
            # seen -- to the detection; from the injection only where it dates none.
            fault_at = det.fields.get("fault_at")
            detected_at = det.fields.get("detected_at", det.time)
            if not isinstance(fault_at, (int, float)) or isinstance(fault_at, bool):
                fault_at = f.fired_at
            rec["detected_after_s"] = round(max(0.0, detected_at - fault_at), 3)
            rec["injected_to_detected_s"] = round(max(0.0, det.time - f.fired_at), 3)
            rec["culprit"] = det.fields.get("culprit", det.fields.get("node"))
            rec["detected_as"] = det.fields.get("kind", det.kind)
            restart = None if f.kind == "disk-full" else next(  # the run goes on
                (e for e in events if e.kind == "round_started" and e.time >= det.time), None)
            if restart is not None:
                # the step the fault's round had reached: what a restore may go up to
                rec["last_step"] = tail.last_step_before_round(restart.round)
            if restart is not None and "restore_tier" in restart.fields:
                # which tier the round restored from, and its step (lazarus.daemon.tier0)
                rec["restored_from_tier"] = restart.fields["restore_tier"]
                rec["restored_step"] = restart.fields.get("restore_step")
            nxt = tail.first_step_after(restart.time) if restart is not None else None
            back = next((e for e in events if e.kind == "recovered"
                         and restart is not None and e.time >= restart.time), None)
            if back is not None:
                # ranks that went on in their processes (docs/inplace.md)
                rec["in_place_ranks"] = back.fields.get("in_place_ranks", 0)
                rec["anew"] = back.fields.get("anew", {})  # why the others started anew
            if nxt is not None:
                rec["recovered_after_s"] = round(nxt[0] - fault_at, 3)
                rec["resumed_at_step"] = nxt[1].get("step")
            elif back is not None and not tail.seen:
                # no metrics of the script's own: the daemon's word that the round runs
                rec["recovered_after_s"] = back.fields.get("recovered_after_s")
    return rec


def run(args: argparse.Namespace) -> dict:
    default = DEMO_OWN_CHAOS if args.command else DEMO_CHAOS
    schedule = chaos.parse_schedule(default if args.chaos is None else
                                    ("" if args.chaos == "none" else args.chaos))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lazarus-up-"))
    previous = [p.name for p in (workdir / "etcd", workdir / "checkpoints", workdir / "nodes")
                if p.exists() and any(p.iterdir())]
    if previous:
        # Its etcd holds the old run's final state, and its checkpoints are the old job's:
        # a run here would report that run's outcome, or refuse the directory mid-way.
        raise UserError(f"--workdir {workdir} holds a previous run ({', '.join(previous)}): "
                        "give a new --workdir, or remove this one")
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = (args.metrics or workdir / "metrics.jsonl").resolve()
    if metrics.exists():
        metrics.unlink()  # this run's story only
    run_as = _run_as(args.run_as, workdir, metrics) if args.run_as is not None else None
    trainer_faults = [f for f in schedule if f.kind in chaos.TRAINER_KINDS]
    own = bool(args.command)  # the user's script, not the built-in trainer
    if own and trainer_faults:
        raise UserError(f"--chaos {trainer_faults[0].label}: the built-in trainer injects "
                        f"{trainer_faults[0].kind}; a script of your own takes kill-worker, "
                        "stop-worker, kill-node, kill-daemon, revive-node, gpu-xid, gpu-ecc")
    if own and any(f.kind in chaos.DISK_KINDS for f in schedule):
        raise UserError("--chaos disk-full/disk-free fill the built-in trainer's checkpoint dir; "
                        "a script of your own keeps its checkpoints where it likes")
    if own and args.replicas != 1:
        raise UserError("--replicas runs the built-in trainer's replica groups; a script of "
                        "your own runs as one world (docs/replicas.md)")
    job = _user_job(args, args.command, metrics) if own else _job(args, workdir, metrics)
    if run_as is not None and own and job.cwd and not run_as.can_pass(Path(job.cwd)):
        raise UserError(f"--run-as {run_as.name}: that user cannot reach this directory "
                        f"({job.cwd}), where your script runs; run from one it can")
    _check_targets(schedule, [f"n{i}" for i in range(args.nodes + args.spares)])
    # the nodes share the job user on this one machine: no agent ends another's ranks
    agent_args = _agent_args(args) + (["--run-as", args.run_as, "--shared-job-user"]
                                      if run_as else [])
    say = print
    if own:
        say(f"lazarus up: {args.nodes} node(s) + {args.spares} spare(s) x {args.nproc_per_node} "
            f"rank(s) of `{' '.join(args.command)}`; workdir {workdir}")
    else:
        say(f"lazarus up: {args.nodes} node(s) + {args.spares} spare(s) x {args.nproc_per_node} "
            f"rank(s), model {args.model}, {args.steps} steps"
            + (f", {args.replicas} replicas of {args.nodes // args.replicas} node(s)"
               if args.replicas > 1 else "") + f"; workdir {workdir}")
    if schedule:
        say("chaos: " + ", ".join(f.label for f in schedule))
    if not own:
        ensure_corpus()  # build once here, not in every rank of the first round

    tail = MetricsTail(metrics)
    events: list = []
    leader_changes: list[tuple[float, int]] = []
    started = time.time()
    with LocalCluster(workdir, lease_ttl_s=args.lease_ttl) as cluster:
        if any(f.kind in chaos.DISK_KINDS for f in schedule):
            say(_small_checkpoint_fs(cluster, job, args))
        # What this run writes, and nothing beside it.
        cluster.allowed_roots = [workdir.resolve(), metrics.parent] + (
            [Path(job.cwd)] if own and job.cwd else [])
        cluster.agent_args += agent_args
        cluster.job_uid = run_as.uid if run_as else None
        cluster.trainer_faults = _rank_faults(trainer_faults, args.nodes * args.nproc_per_node)
        cluster.start_etcd()
        say(f"etcd: {cluster.endpoint}, TLS with client certificates and authentication on "
            f"(certificates and passwords in {cluster.etcd_server.security.directory})")
        cluster.start_daemon()
        cluster.start_daemon()
        _publish_api(cluster)
        say(f"a fault by hand: lazarus chaos KIND --node NODE --workdir {workdir}")
        for i in range(args.nodes + args.spares):
            cluster.start_agent(f"n{i}", nproc=args.nproc_per_node,
                                role=ROLE_ACTIVE if i < args.nodes else ROLE_SPARE)
        cluster.submit(job)
        pending = [f for f in schedule if f.kind not in chaos.TRAINER_KINDS]
        last_print = 0.0
        leader = None
        state = None
        clock = chaos.RunClock()  # the clock of timed chaos items
        waiting: dict[int, tuple[float, str]] = {}  # id(item) waiting for its target -> since, why
        reported = 0          # the furthest step a script of the user's own reported
        while time.time() - started < args.timeout:
            time.sleep(0.05)
            cluster.keep_disk_full()
            tail.poll()
            st = cluster.state()
            reported = max([reported] + [ns.step for n, ns in st.node_status.items()
                                         if st.status and n in st.status.members])
            if st.leader_pid and st.leader_pid != leader:
                if leader is not None:
                    leader_changes.append((time.time(), st.leader_pid))
                    say(f"  ! leader is now daemon pid {st.leader_pid}")
                leader = st.leader_pid
            for ev in cluster.new_events():
                events.append(ev)
                say(event_line(ev))
            step = tail.latest["step"] if tail.latest else reported
            state = st.status.state if st.status else "PENDING"
            for fault in trainer_faults:
                # it strikes as step `fault.step` starts, i.e. once the step before is done
                if fault.fired_at is None and step >= fault.step - 1:
                    # the trainer injected it itself, at the data that step reads
                    fault.fired_at, fault.fired_step = time.time(), step
                    fault.hit = "all ranks" if fault.kind.startswith("slow-") else "data"
                    say(f"  >> {fault.kind} injected by the trainer at step {fault.step}")
            running_s = clock.advance(time.time(), st.status is not None and chaos.running(
                st.status.state, st.status.members, st.status.round, st.node_status))
            due = next((f for f in pending if f.due(step, running_s)), None)
            if (due is not None and state == "RUNNING" and st.status.incident is None
                    and not _unanswered(schedule, events)):
                since, why = waiting.get(id(due), (time.time(), ""))
                target = chaos.aim(due, _sight(cluster, st), time.time() - since)
                if target.action == chaos.FIRE:
                    try:
                        _inject(cluster, due, target.node, step)
                    except (RuntimeError, ProcessLookupError) as e:
                        # what it aimed at went between the look and the shot: look again
                        due.fired_at = due.fired_step = None
                        target = chaos.Aim(chaos.WAIT, target.node, str(e))
                if target.action == chaos.SKIP:
                    due.skipped = target.why
                    pending.remove(due)
                    say(f"  .. {due.label} skipped: {target.why}")
                elif target.action == chaos.WAIT:
                    if why != target.why:
                        say(f"  .. {due.label} waits: {target.why}")
                    waiting[id(due)] = (since, target.why)
                else:
                    pending.remove(due)
                    say(f"  >> injected {due.kind} at " + (f"{running_s:.0f} s" if due.seconds
                                                            else f"step {step}") + f": {due.hit}")
            if own and not args.quiet and time.time() - last_print >= 5.0:
                last_print = time.time()
                say(f"  {state} round {st.status.round if st.status else 0} members "
                    f"{','.join(st.status.members) if st.status else '-'}"
                    + (f", step {step}" if step else "")
                    + f" ({time.time() - started:.0f} s; the ranks' output: "
                      f"{workdir / 'nodes' / 'logs'})")
            if not own and not args.quiet and time.time() - last_print >= 1.0 and tail.latest:
                last_print = time.time()
                m = tail.latest
                say(f"step {m['step']:>5}/{args.steps}  loss {m['loss']:.4f}  "
                    f"{m.get('tokens', 0) / max(m.get('step_time_s', 1e-9), 1e-9):>8.0f} tok/s  "
                    f"| {state} round {st.status.round if st.status else 0} "
                    f"members {','.join(st.status.members) if st.status else '-'}")
            if st.status is not None and st.status.state in TERMINAL:
                break
        else:
            state = "TIMEOUT"
        for ev in cluster.new_events():
            events.append(ev)
            say(event_line(ev))
        for fault in pending:
            fault.skipped = (f"the run ended first ({waiting[id(fault)][1]})"
                             if id(fault) in waiting else "the run ended first")
        tail.poll()
        checkpoints = cluster.state().checkpoints
    # The run's story outlives the cluster: `lazarus report WORKDIR` reads these files.
    (workdir / "events.jsonl").write_text("".join(ev.to_json().decode() + "\n" for ev in events))
    (workdir / "checkpoints.jsonl").write_text("".join(
        c.to_json().decode() + "\n" for c in sorted(checkpoints, key=lambda c: c.step)))
    page = None
    if metrics.exists():
        page = report.write(metrics, events=workdir / "events.jsonl",
                            out=workdir / "report.html")
        say(f"report: {page}")
    steps = max((rec["step"] for _, rec in tail.seen), default=reported)
    summary = {
        "final_state": state,
        "steps_completed": steps,
        "wall_time_s": round(time.time() - started, 2),
        "faults": [f.as_dict() for f in schedule],
        "recoveries": _recoveries(schedule, events, tail, leader_changes),
        "final_loss": tail.latest["loss"] if tail.latest else None,
        "skipped_steps": sorted({rec["step"] for _, rec in tail.seen if rec.get("skipped")}),
        "workdir": str(workdir),
        "metrics": str(metrics),
        "report": str(page) if page else None,
    }
    return summary


def print_summary(summary: dict) -> None:
    if summary["steps_completed"] or summary["final_loss"] is not None:
        print(f"\n{summary['final_state']}: {summary['steps_completed']} steps in "
              f"{summary['wall_time_s']:.1f} s, final loss {summary['final_loss']}")
    else:  # a script that reports no steps (level 0): what it did is in its own output
        print(f"\n{summary['final_state']} in {summary['wall_time_s']:.1f} s; steps and loss "
              f"unknown: the script reports none (its output: {summary['workdir']}/nodes/logs)")
    for f in summary["faults"]:
        if f.get("skipped"):
            print(f"not injected: {f['item']} -- {f['skipped']}")
    if summary["recoveries"]:
        print(f"{'fault':<12} {'at step':>7} {'target':<16} {'detected':>9} {'recovered':>10}  "
              f"{'culprit':<8} restored")
        for r in summary["recoveries"]:
            det = "-" if r["detected_after_s"] is None else f"{r['detected_after_s']:.2f} s"
            rec = "-" if r["recovered_after_s"] is None else f"{r['recovered_after_s']:.2f} s"
            tier = r.get("restored_from_tier")
            restored = ("-" if tier is None else
                        f"step {r['restored_step']} from {'memory' if tier == 0 else 'storage'}")
            # the culprit is what an event named, and agents write events
            print(printable(f"{r['kind']:<12} {r['fault_step'] or '-':>7} "
                            f"{str(r['target']):<16} {det:>9} {rec:>10}  "
                            f"{r['culprit'] or '-':<8} {restored}"))


def main(argv: list[str]) -> int:
    args = _parse(argv)
    disk = chaos.parse_schedule("" if args.chaos in (None, "none") else args.chaos)
    if any(f.kind in chaos.DISK_KINDS for f in disk) and not diskfault.in_private_namespace():
        diskfault.rerun_in_namespace(["up", *argv])  # does not return
    summary = run(args)
    print_summary(summary)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["final_state"] == "SUCCEEDED" else 1
