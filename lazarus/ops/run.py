"""`lazarus run [OPTIONS] -- COMMAND ARGS...`: run your own training script under Lazarus, as
torchrun would run it, on the cluster's nodes (docs/adopting.md).

Submits a job whose ranks run COMMAND in torchrun's environment, follows it -- the run's events
as they come -- and exits with its outcome: 0 only when it SUCCEEDED, 1 when it FAILED, was
CANCELLED or rejected. Stopping this command (Ctrl-C) leaves the run going (`lazarus cancel`
ends it).

Two ways in. Users go through the daemons' API with a submit token (--address, --token-file,
as `lazarus status` takes them; lazarus.ops.apirun): the default whenever a daemon is known
(--address, $LAZARUS_ADDRESS or the endpoint file). With --etcd (or, no daemon known,
$LAZARUS_ETCD) the job is written into etcd directly and followed there, which needs the
daemons' etcd credentials: for operators and a local cluster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lazarus.core import etcd as E
from lazarus.core import jobcommand, jobspec, settings
from lazarus.ops import apirun, client
from lazarus.core.consoletext import printable
from lazarus.core.contract import METRICS_ENV
from lazarus.core.errors import UserError
from lazarus.core.eventfeed import EventFeed
from lazarus.core.records import (EventRecord, Keys, RecordError, RunStatus, SUCCEEDED,
                                  TERMINAL)

# How often the run's events and status are read: once a second is plenty for a person, and
# two small reads a second are nothing for etcd.
POLL_S = 1.0


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(options, command): what comes after the first `--` is the command."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def job_options(p: argparse.ArgumentParser, *, nodes: int) -> None:
    """The options of a job of the user's command, shared with `lazarus up -- ...`."""
    p.add_argument("--nodes", type=int, default=nodes, help="nodes the run wants (default %(default)s)")
    p.add_argument("--min-nodes", type=int, default=None,
                   help="the run goes on, with the same global batch if the script keeps it, "
                        "on as few as this many nodes when no spare is left (default: --nodes)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--max-restarts", type=int, default=20,
                   help="recoveries before the run is declared FAILED (default %(default)s)")
    p.add_argument("--rdzv-timeout", type=float, default=120.0,
                   help="seconds a round's ranks have to start and join their process group "
                        "(default %(default)s)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="add to every rank's environment (repeatable)")
    p.add_argument("--cwd", default=None,
                   help="where the ranks start (default: this directory)")
    p.add_argument("--name", default=None, help="the job's name (default: the script's)")
    p.add_argument("--spares-ok", action="store_true",
                   help="the first round may start on spare nodes when too few active ones "
                        "are free (default: spares wait for a fault)")


def build_job(args: argparse.Namespace, command: list[str], *, check: bool) -> jobspec.JobSpec:
    """The job of `command` with these options; UserError naming what is wrong. `check`:
    the command must be runnable here too (this machine is one of the agents')."""
    if not command:
        raise UserError("no command: put it after --, e.g. `-- python train.py --lr 3e-4`")
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UserError(f"--env {item!r} is not NAME=VALUE")
        env[name] = value
    if getattr(args, "metrics_file", None):
        env.setdefault(METRICS_ENV, os.path.abspath(args.metrics_file))
    cwd = os.path.abspath(args.cwd or os.getcwd())
    doc = {"job": {"name": args.name or _name(command), "nodes": args.nodes,
                   "min_nodes": args.min_nodes if args.min_nodes is not None else args.nodes,
                   "nproc_per_node": args.nproc_per_node, "max_restarts": args.max_restarts,
                   "rendezvous_timeout_s": args.rdzv_timeout, "command": command,
                   "env": env, "cwd": cwd, "start_on_spares": args.spares_ok}}
    for flag in ("nodes", "nproc_per_node"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    job = jobspec.from_dict(doc, source="lazarus run")
    if check:
        jobcommand.check_runnable(job.command, cwd=job.cwd)
    return job


# Programs that run a script named next: a job of `bash train.sh` is named train.sh
_SHELLS = ("sh", "bash", "dash", "zsh")


def _name(command: list[str]) -> str:
    named_by_script = (jobcommand.how_run(command) != jobcommand.PROGRAM
                       or os.path.basename(command[0]) in _SHELLS)
    words = [a for a in command[1:] if not a.startswith("-")] if named_by_script else command
    return os.path.basename(words[0] if words else command[0]) or "job"


class Follower:
    """The run's events since a point in time, and its status, read from etcd."""

    def __init__(self, etcd: E.Etcd, keys: Keys, *, since_ns: int):
        self.etcd, self.keys = etcd, keys
        self._events = EventFeed(etcd, keys, since_ns=since_ns)

    def new_events(self) -> list[EventRecord]:
        return self._events.new_events()

    def status(self, job_id: str) -> RunStatus | None:
        kv = self.etcd.get(self.keys.status)
        if kv is None:
            return None
        try:
            st = RunStatus.from_json(kv.value)
        except RecordError:
            return None
        return st if st.job_id == job_id else None


def event_line(ev: EventRecord) -> str:
    """How `lazarus run` and `lazarus up` print an event: one line, whatever its message."""
    return printable(f"  [{ev.kind}] {ev.message}")


def follow(etcd: E.Etcd, keys: Keys, job: jobspec.JobSpec, *, since_ns: int,
           timeout_s: float | None = None, say=print) -> str:
    """Print the run's events until it ends; its final state ("TIMEOUT" past `timeout_s`)."""
    f = Follower(etcd, keys, since_ns=since_ns)
    started = time.monotonic()
    outage = False
    while timeout_s is None or time.monotonic() - started < timeout_s:
        try:
            for ev in f.new_events():
                say(event_line(ev))
            st = f.status(job.id)
            outage = False
        except E.EtcdUnavailable as e:
            if not outage:
                say(f"  ! {e}; the run goes on, retrying")
            outage = True
            st = None
        if st is not None and st.state in TERMINAL:
            for ev in f.new_events():
                say(event_line(ev))
            return st.state
        time.sleep(POLL_S)
    return "TIMEOUT"


WAYS_IN = ("Through the daemons' API (the default whenever a daemon is known: --address, "
           "$LAZARUS_ADDRESS or the endpoint file), with a submit token (--token-file); "
           "--etcd writes the job into etcd directly instead, with the daemons' etcd "
           "credentials (operators, a local cluster).")


def add_ways_in(p: argparse.ArgumentParser) -> None:
    """The daemon's API flags and etcd's, --etcd without a default: given, it picks etcd."""
    client.daemon_args(p)
    settings.add_etcd_args(p, etcd_help="write the job into this etcd (HOST:PORT, several "
                           "HOST:PORT,HOST:PORT) instead of going through the API; needs the "
                           f"daemons' etcd credentials (default: ${settings.ETCD_ENV} when no "
                           "daemon is known)")
    p.set_defaults(etcd=None)


def by_etcd(args: argparse.Namespace) -> bool:
    """Whether the job goes into etcd directly (see WAYS_IN); fills args.etcd when it does.
    UserError when both ways are named, or neither is known."""
    if args.etcd is not None:
        if args.address:
            raise UserError("give --address (the daemons' API) or --etcd, not both")
        return True
    if client.address_known(args):
        return False
    if os.environ.get(settings.ETCD_ENV):
        args.etcd = os.environ[settings.ETCD_ENV]
        return True
    raise UserError("no daemon known: give --address HOST:PORT and --token-file FILE (the "
                    "daemons' API, with the submit token your operator gave you), or --etcd "
                    "HOST:PORT with the daemons' etcd credentials")


def main(argv: list[str]) -> int:
    options, command = split_command(argv)
    p = argparse.ArgumentParser(prog="lazarus run", usage="lazarus run [OPTIONS] -- COMMAND [ARGS...]",
                                description=__doc__.split("\n\n")[0] + " " + WAYS_IN)
    add_ways_in(p)
    job_options(p, nodes=1)
    p.add_argument("--no-local-check", action="store_true",
                   help="do not check that COMMAND can start on this machine (the agents "
                        "check it on theirs)")
    p.add_argument("--detach", action="store_true", help="submit and exit, without following")
    p.add_argument("--metrics", dest="metrics_file", default=None, metavar="FILE",
                   help="rank 0 of a script that reports its steps (level 1) appends them "
                        "here, for `lazarus report` (sets $LAZARUS_METRICS)")
    args = p.parse_args(options)
    job = build_job(args, command, check=not args.no_local_check)
    if not by_etcd(args):
        return _through_api(args, job, command)
    keys = Keys(args.root)
    etcd = E.Etcd(args.etcd, auth=settings.etcd_auth(args))
    try:
        since = time.time_ns()
        try:
            kv = etcd.get(keys.status)
            current = RunStatus.from_json(kv.value) if kv is not None else None
        except RecordError:
            current = None
        if current is not None and current.state not in TERMINAL:
            raise UserError(f"run {current.job_id} is {current.state}: one run at a time; "
                            "`lazarus cancel` ends it")
        etcd.put(keys.job, job.to_json())
        print(f"lazarus run: job {job.name!r} ({job.id}): {job.nodes} node(s) x "
              f"{job.nproc_per_node} rank(s), min {job.min_nodes}: {' '.join(command)}",
              flush=True)
        if args.detach:
            return 0
        try:
            state = follow(etcd, keys, job, since_ns=since)
        except KeyboardInterrupt:
            print("lazarus run: stopped following; the run goes on (`lazarus cancel` ends it)",
                  file=sys.stderr)
            return 130
    except E.EtcdUnavailable as e:
        print(f"lazarus run: error: {e}", file=sys.stderr)
        return 1
    finally:
        etcd.close()
    print(f"{state}: job {job.name!r} ({job.id})")
    return 0 if state == SUCCEEDED else 1


def _through_api(args: argparse.Namespace, job: jobspec.JobSpec, command: list[str]) -> int:
    try:
        target = client.target(args)
        reply = apirun.submit(target, apirun.job_toml(job))
        print(f"lazarus run: job {job.name!r} ({reply.job_id}): {job.nodes} node(s) x "
              f"{job.nproc_per_node} rank(s), min {job.min_nodes}: {' '.join(command)}",
              flush=True)
        if args.detach:
            return 0
        try:
            state = apirun.follow(target, reply.job_id, after_revision=reply.revision,
                                  say=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            print("lazarus run: stopped following; the run goes on (`lazarus cancel` ends it)",
                  file=sys.stderr)
            return 130
    except client.Failed as e:
        print(printable(f"lazarus run: error: {e}"), file=sys.stderr)
        return e.code
    print(f"{state}: job {job.name!r} ({reply.job_id})")
    return 0 if state == SUCCEEDED else 1
