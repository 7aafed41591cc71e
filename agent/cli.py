"""`lazarus agent`'s command line: its flags, checked, turned into an `Agent` and run until
SIGTERM or SIGINT (lazarus.agent.service)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from lazarus.agent import service
from lazarus.agent.hang import LONG_CAP_S, LONG_FLOOR_S, HangConfig
from lazarus.agent.agentconfig import PREFLIGHT_EVERY_S, STATUS_PERIOD_S, AgentConfig
from lazarus.agent.service import Agent
from lazarus.agent.stacks import FLIGHT_ENTRIES
from lazarus.agent.tier0_agent import add_tier0_args, tier0_options
from lazarus.agent.workers import RANK_LOG_BYTES
from lazarus.core import etcd as E
from lazarus.core import jobuser, logs, settings
from lazarus.core.errors import UserError
from lazarus.core.records import ROLE_ACTIVE, Keys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lazarus agent",
                                description=service.__doc__.split("\n\n")[0])
    settings.add_etcd_args(p, lease_ttl=settings.LEASE_TTL_S, lease_help="node lease TTL in seconds")
    p.add_argument("--node", default=socket.gethostname(), help="node id (default: hostname)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (worker processes) on this node")
    p.add_argument("--role", default=ROLE_ACTIVE, help="active or spare")
    p.add_argument("--host", default="127.0.0.1", help="address peers reach this node at")
    p.add_argument("--workdir", default=os.environ.get("LAZARUS_WORKDIR", "/tmp/lazarus"),
                   help="the worker socket, worker logs, stacks and hang reports; created "
                        "mode 0700 if missing, refused if others may enter it "
                        "(default: $LAZARUS_WORKDIR, else /tmp/lazarus)")
    p.add_argument("--no-park", action="store_true", help="do not keep warm parked workers")
    p.add_argument("--gpu-backend", default="auto", choices=("auto", "nvml", "sim"),
                   help="GPU health source: NVML, the simulated backend, or auto (NVML when "
                        "it finds a GPU)")
    p.add_argument("--hang-k", type=float, default=3.0,
                   help="a rank hangs after k x the median step time without progress")
    p.add_argument("--hang-floor", type=float, default=10.0,
                   help="... and never before this many seconds")
    p.add_argument("--first-step-timeout", type=float, default=HangConfig().first_step_timeout_s,
                   help="a rank hangs after this many seconds without progress before two of "
                        "its steps were timed; a script that reports no steps (level 0, "
                        "docs/adopting.md) always has this allowance between its collectives "
                        "(default %(default)s)")
    p.add_argument("--rank-log-mb", type=float, default=RANK_LOG_BYTES / (1 << 20),
                   help="a rank's log file (WORKDIR/logs/NODE/round-R/rank-N.log) is rotated "
                        "past this size, one old copy kept (default %(default)s)")
    p.add_argument("--long-phase-floor", type=float, default=LONG_FLOOR_S,
                   help="a checkpoint or eval phase hangs after %(default)s s or 4x its "
                        "median duration so far, whichever is longer (at most 600 s)")
    p.add_argument("--flight-entries", type=int, default=FLIGHT_ENTRIES,
                   help="collectives torch's flight recorder keeps per process group of each "
                        "rank, read for a hang's report (default %(default)s); 0 turns it off")
    p.add_argument("--gpu-faults", type=Path, default=None,
                   help="fault script of the simulated GPU backend (default: "
                        "WORKDIR/NODE.gpu-faults.json; `lazarus chaos gpu-xid` writes it)")
    p.add_argument("--min-free-mb", type=float, default=None,
                   help="host monitor: the checkpoint dir fails below this much free space "
                        "(default 1024)")
    p.add_argument("--low-free-mb", type=float, default=None,
                   help="... and is degraded below this much (default 10240)")
    p.add_argument("--monitors", choices=("on", "off"), default="on",
                   help="GPU, host, hang and throughput monitors and the workers' progress "
                        "reports; 'off' exists to measure what they cost")
    p.add_argument("--status-period", type=float, default=STATUS_PERIOD_S,
                   help="seconds between node status writes while only the step moves (a "
                        "change of state is written at once) (default %(default)s)")
    p.add_argument("--preflight-every", type=float, default=PREFLIGHT_EVERY_S,
                   help="seconds between the preflight checks of a node that runs no ranks "
                        "(`lazarus preflight`); 0: only at start (default %(default)s)")
    p.add_argument("--preflight", choices=("on", "off"), default="on",
                   help="'off': no preflight checks, and the daemon does not wait for them")
    add_tier0_args(p)
    p.add_argument("--allowed-root", action="append", default=None, metavar="DIR",
                   help="a directory jobs may have this node's ranks write in (their "
                        "checkpoint dir, their metrics); repeat for more. A job with a path "
                        "outside them fails at its start with the reason (default: the workdir)")
    p.add_argument("--run-as", default=None, metavar="USER",
                   help="run the ranks (the job's code) as this user, not the agent's: they "
                        "then cannot read the agent's credentials or touch its files "
                        "(docs/security.md). Needs a root agent, or the capabilities "
                        "listed there; the default --allowed-root becomes WORKDIR/job, "
                        "that user's")
    p.add_argument("--shared-job-user", action="store_true",
                   help="the --run-as user also runs other agents' ranks on this host (a "
                        "local cluster of several nodes on one machine): at a change of job "
                        "do not end that user's other processes (docs/security.md)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logs.setup(args.log_level, f"agent[{args.node}]")
    if args.preflight_every < 0:
        raise UserError("--preflight-every must be 0 (only at start) or a number of seconds")
    if not args.status_period > 0:
        raise UserError("--status-period must be positive")
    if args.nproc < 1:
        raise UserError("--nproc must be at least 1")
    settings.check_lease_ttl(args.lease_ttl)
    if args.flight_entries < 0:
        raise UserError("--flight-entries must be 0 (no flight recorder) or a number of "
                        f"collectives, not {args.flight_entries}")
    if not args.first_step_timeout > 0 or not args.rank_log_mb > 0:
        raise UserError("--first-step-timeout and --rank-log-mb must be positive")
    if args.hang_k <= 1 or args.hang_floor <= 0:
        raise UserError("--hang-k must be above 1 and --hang-floor positive")
    if not 0 < args.long_phase_floor <= LONG_CAP_S:
        raise UserError(f"--long-phase-floor must be above 0 and at most {LONG_CAP_S:.0f} s, "
                        f"got {args.long_phase_floor}")
    run_as = None
    if args.run_as is not None:
        run_as = jobuser.JobUser.resolve(args.run_as)
        jobuser.check_agent_may_switch()
    host_limits = _host_limits(args)
    etcd = E.Etcd(args.etcd, auth=settings.etcd_auth(args))
    _check_credentials(etcd, Keys(args.root))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent = Agent(etcd, Keys(args.root), AgentConfig(
        node=args.node, nproc=args.nproc, role=args.role, workdir=Path(args.workdir),
        host=args.host, lease_ttl_s=args.lease_ttl, park=not args.no_park,
        gpu_backend=args.gpu_backend, gpu_faults=args.gpu_faults,
        hang=HangConfig(k=args.hang_k, floor_s=args.hang_floor,
                        long_floor_s=args.long_phase_floor,
                        first_step_timeout_s=args.first_step_timeout),
        rank_log_bytes=int(args.rank_log_mb * (1 << 20)),
        host_limits=host_limits, monitors=args.monitors == "on",
        status_period_s=args.status_period,
        preflight_every_s=args.preflight_every if args.preflight == "on" else None,
        tier0=tier0_options(args, Path(args.workdir), run_as.uid if run_as else None),
        # absolute: the ranks resolve them, whatever their working directory
        allowed_roots=[os.path.abspath(r) for r in args.allowed_root or [
            jobuser.job_dir(Path(args.workdir)) if run_as else args.workdir]],
        flight_entries=args.flight_entries, run_as=run_as,
        fence_jobs=not args.shared_job_user))
    try:
        agent.run(stop)
    finally:
        etcd.close()
    # Not through the interpreter's exit: a preflight stopped midway leaves torch's threads (a
    # gloo group's, a store's) unjoined, and a C++ thread destroyed unjoined aborts the process
    # ("terminate called without an active exception": exit -6 after a clean stop, where
    # systemd and the tests expect 0). Everything the agent owns is settled by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_credentials(etcd: E.Etcd, keys: Keys) -> None:
    """One read before the node's workers start: a wrong password is said at once (EtcdAuthFailed,
    a UserError), not after the seconds a zygote takes to import torch. An etcd that is away
    or refuses for now is waited out by the agent's loop, as at any other time."""
    try:
        etcd.get(keys.job)
    except E.EtcdUnavailable:
        pass


def _host_limits(args: argparse.Namespace) -> dict:
    limits = {}
    for flag, name in (("min_free_mb", "min_free_bytes"), ("low_free_mb", "low_free_bytes")):
        value = getattr(args, flag)
        if value is not None:
            if value < 0:
                raise UserError(f"--{flag.replace('_', '-')} must not be negative")
            limits[name] = int(value * (1 << 20))
    return limits
