"""The operator CLI on the gRPC API: `lazarus status|nodes|events|checkpoints|checkpoint now|
drain|cordon|uncordon|pause|resume|cancel`.

It finds the daemons from --address/--token (or --token-file), else $LAZARUS_ADDRESS /
$LAZARUS_TOKEN, else the endpoint file `lazarus daemon` and `lazarus up` leave (see
lazarus.core.endpoint_file). Several addresses (HOST:PORT,HOST:PORT) are tried in turn: one
that refuses the connection, makes none within CONNECT_S, or whose daemon cannot reach etcd
gives way to the next. A read (status, nodes, events, checkpoints) takes the first that
answers. A command goes to the daemon that says it leads (GetRunHealth's served_by_leader),
else to the first that answers: any daemon takes one (it is an etcd write the leader acts
on), the leader first so that the daemon that checks it (the node exists, the run's state
fits) is the one that acts on it. That costs a GetRunHealth per daemon asked, and only with
several addresses. The token is the admin one, the daemon's submit one (a user's: jobs, no
operator commands) or its read-only one; a command the token may not call is refused with
exit code 4. `lazarus run` and `lazarus submit` reach the API through daemon_args and target
too (lazarus.ops.apirun). Tables by default, --json for scripts (events: one
JSON object per line).

Exit codes: 0 done; 1 the daemon refused (no such node, not in this run state, ...);
2 a bad argument; 3 the daemon (or its etcd) is unreachable; 4 the token was refused, or is
read-only and the command needs the admin token.
This module must stay light: no torch, nothing of the daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import json_format

from lazarus.core import endpoint_file, settings
from lazarus.core.consoletext import printable
from lazarus.core.errors import UserError
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.proto.lazarus.v1 import lazarus_pb2_grpc as pb_grpc

EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH = 1, 2, 3, 4
# How long an address that is not the last may take to connect (TCP, and TLS's handshake)
# before the next is tried: a host that is down drops the packets, and would otherwise hold
# the CLI for the whole --timeout before the next daemon is asked.
CONNECT_S = 3.0
# Reads: any daemon serves them as well as the leader. Every other method is a command.
_READS = frozenset({"GetRunHealth", "ListNodes", "ListCheckpoints", "WatchEvents"})


class Failed(Exception):
    """The call failed: a one-line message and the exit code that goes with it; `why`, for an
    unreachable daemon, is the short reason a list of several names it by."""

    def __init__(self, message: str, code: int, why: str = ""):
        super().__init__(message)
        self.code = code
        self.why = why


@dataclass(kw_only=True, slots=True)
class Target:
    addresses: list[str]
    token: str | None = None
    tls_ca: str | None = None        # None and tls False: plaintext
    tls: bool = False
    client_cert: str | None = None   # mutual TLS
    client_key: str | None = None
    timeout_s: float = 10.0
    source: str = ""                 # where the address came from, for error messages


def _common(p: argparse.ArgumentParser) -> None:
    daemon_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def daemon_args(p: argparse.ArgumentParser) -> None:
    """How to reach the daemons' API, as every command on it takes it (`target(args)`)."""
    g = p.add_argument_group("daemon")
    g.add_argument("--address", help="daemon API HOST:PORT, or several HOST:PORT,HOST:PORT "
                   "tried in turn, commands to the leader first (default: $LAZARUS_ADDRESS, "
                   "else the endpoint file left by `lazarus daemon` / `lazarus up`)")
    g.add_argument("--token", help="bearer token, admin, submit or read-only (default: "
                   "$LAZARUS_TOKEN or the endpoint file); prefer --token-file, which does not "
                   "show in `ps`")
    g.add_argument("--token-file", help="file holding the bearer token")
    g.add_argument("--tls", action="store_true", help="use TLS (implied by --tls-ca)")
    g.add_argument("--tls-ca", help="CA certificate (PEM) to trust for the daemon")
    g.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    g.add_argument("--tls-key", help="client key (PEM) for mutual TLS")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds per call")


def address_known(args: argparse.Namespace) -> bool:
    """Whether daemon_args' flags, the environment or an endpoint file name a daemon."""
    return bool(args.address or os.environ.get(settings.ADDRESS_ENV)
                or endpoint_file.default_path().exists())


def target(args: argparse.Namespace) -> Target:
    """The daemons daemon_args' flags name (else the environment, the endpoint file); Failed
    when none is known."""
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    token = args.token or (endpoint_file.load_token(args.token_file) if args.token_file
                           else None)
    address = args.address or os.environ.get(settings.ADDRESS_ENV)
    if address:
        source = "--address" if args.address else f"${settings.ADDRESS_ENV}"
        addresses = settings.api_addresses(address, source)
        file_ep = None
    else:
        path = endpoint_file.default_path()
        file_ep = endpoint_file.read(path)
        if file_ep is None or not file_ep.addresses:
            raise Failed("no daemon known: start one (`lazarus daemon`, `lazarus up`) or give "
                         f"--address (looked in $LAZARUS_ADDRESS and {path})", EXIT_UNREACHABLE)
        if file_ep.pid and not _alive(file_ep.pid):
            raise Failed(f"the daemon that wrote {path} (pid {file_ep.pid}) has exited; start "
                         "one or give --address", EXIT_UNREACHABLE)
        source = str(path)
        addresses = [settings.check_api_address(a, f"endpoint file {source!r}")
                     for a in file_ep.addresses]
    token = token or os.environ.get("LAZARUS_TOKEN") or (file_ep.token if file_ep else None)
    tls_ca = args.tls_ca or (file_ep.tls_ca if file_ep else None)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("mutual TLS needs both --tls-cert and --tls-key")
    return Target(addresses=addresses, token=token, tls_ca=tls_ca,
                  tls=bool(args.tls or tls_ca or args.tls_cert), client_cert=args.tls_cert,
                  client_key=args.tls_key, timeout_s=args.timeout, source=source)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{path!r} is unreadable ({e.strerror})") from None


def _channel(target: Target, address: str) -> grpc.Channel:
    if target.tls:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(target.tls_ca),
                                             private_key=_read(target.client_key),
                                             certificate_chain=_read(target.client_cert))
        return grpc.secure_channel(address, creds)
    return grpc.insecure_channel(address)


def _metadata(target: Target) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {target.token}")] if target.token else []


def _failure(err: grpc.RpcError, address: str, target: Target) -> Failed:
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        hint = "" if target.token else " (no token given: --token-file or $LAZARUS_TOKEN)"
        return Failed(f"the daemon at {address} refused the token: {details}{hint}", EXIT_AUTH)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return Failed(f"the daemon at {address} refused: {details}", EXIT_AUTH)
    if code == grpc.StatusCode.UNAVAILABLE and details.startswith("etcd"):
        return Failed(f"the daemon at {address} answered: {details}", EXIT_UNREACHABLE,
                      why=f"{address} answered: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return _unreachable(address, details.splitlines()[0] if details else code.name, target)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Failed(details, EXIT_USAGE)
    return Failed(details or code.name, EXIT_REFUSED)


def _unreachable(address: str, why: str, target: Target) -> Failed:
    return Failed(f"cannot reach the daemon at {address} ({why}; from {target.source})",
                  EXIT_UNREACHABLE, why=f"{address}: {why}")


def _none_answered(failures: list[Failed], target: Target) -> Failed:
    if len(failures) == 1:
        return failures[0]
    return Failed(f"no daemon answered ({'; '.join(f.why for f in failures)}; from "
                  f"{target.source})", EXIT_UNREACHABLE)


def _connected(channel: grpc.Channel, seconds: float) -> bool:
    """Whether the channel got past connecting within `seconds`: ready, or failed for a reason
    (refused, a TLS handshake gone wrong) that a call on it then gives at once."""
    settled = threading.Event()

    def watch(state: grpc.ChannelConnectivity) -> None:
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                     grpc.ChannelConnectivity.SHUTDOWN):
            settled.set()

    channel.subscribe(watch, try_to_connect=True)
    try:
        return settled.wait(seconds)
    finally:
        channel.unsubscribe(watch)


def _channels(target: Target, addresses: list[str],
              failures: list[Failed]) -> Iterator[tuple[str, grpc.Channel]]:
    """Each address in turn with an open channel to it, closed when the next is asked for.
    One that does not connect within CONNECT_S is passed over, its failure added to
    `failures`; the last one is not timed apart: the call's own deadline rules it."""
    wait_s = min(CONNECT_S, target.timeout_s)
    for i, address in enumerate(addresses):
        with _channel(target, address) as channel:
            if i + 1 < len(addresses) and not _connected(channel, wait_s):
                failures.append(_unreachable(address, f"no connection within {wait_s:g} s",
                                             target))
                continue
            yield address, channel


def _answers(target: Target, addresses: list[str], method: str,
             request) -> Iterator[tuple[str, object]]:
    """(address, reply) of each daemon of `addresses` that answers the unary `method`, in
    turn; an unreachable one is passed over, any other failure raised as Failed, and so are
    the unreachable ones when none answered."""
    failures: list[Failed] = []
    answered = False
    for address, channel in _channels(target, addresses, failures):
        try:
            reply = getattr(pb_grpc.LazarusStub(channel), method)(
                request, timeout=target.timeout_s, metadata=_metadata(target))
        except grpc.RpcError as e:
            failure = _failure(e, address, target)
            if failure.code != EXIT_UNREACHABLE:
                raise failure from None
            failures.append(failure)
            continue
        answered = True
        yield address, reply
    if not answered:
        raise _none_answered(failures, target)


def _leader_first(target: Target) -> list[str]:
    """The addresses to send a command to: the first whose daemon says it leads, then those
    that answered before it as standbys, then the untried rest; without a leader among them,
    those that answered. Addresses that did not answer are left out: a second try would cost
    a second connect deadline."""
    answered: list[str] = []
    with contextlib.closing(_answers(target, target.addresses, "GetRunHealth",
                                     pb.GetRunHealthRequest())) as answers:
        for address, health in answers:
            if health.served_by_leader:
                rest = target.addresses[target.addresses.index(address) + 1:]
                return [address, *answered, *rest]
            answered.append(address)
    return answered


def call_at(target: Target, method: str, request) -> tuple[str, object]:
    """A unary call and the address that answered it: a read on the first address that
    answers, a command on the leader's first (see the module's docstring)."""
    addresses = target.addresses
    if method not in _READS and len(addresses) > 1:
        addresses = _leader_first(target)
    with contextlib.closing(_answers(target, addresses, method, request)) as answers:
        return next(answers)


def call(target: Target, method: str, request):
    """A unary call's reply (see call_at)."""
    return call_at(target, method, request)[1]


def stream_events(target: Target, request: pb.WatchEventsRequest) -> Iterator[pb.Event]:
    failures: list[Failed] = []
    with contextlib.closing(_channels(target, target.addresses, failures)) as daemons:
        for address, channel in daemons:
            # A followed stream has no deadline; a plain listing has the usual one.
            timeout = None if request.follow else target.timeout_s
            delivered = False
            try:
                for ev in pb_grpc.LazarusStub(channel).WatchEvents(
                        request, timeout=timeout, metadata=_metadata(target)):
                    delivered = True
                    yield ev
                return
            except grpc.RpcError as e:
                failure = _failure(e, address, target)
                # Another daemon would replay what was printed already: stop here instead.
                if failure.code != EXIT_UNREACHABLE or delivered:
                    raise failure from None
                failures.append(failure)
    raise _none_answered(failures, target)


# -- output ------------------------------------------------------------------------------------
# Node names, reasons, paths and event messages come from agents (etcd's node and event
# records), which any node's credentials can write: all of it goes through `printable`.
def _add(table, *cells: str) -> None:
    """A row of Text cells, never parsed as markup: "[bold red]" in a node name is its name."""
    from rich.text import Text
    table.add_row(*(Text(printable(c)) for c in cells))


def _console():
    from rich.console import Console
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _as_dict(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _print_json(msg) -> None:
    print(json.dumps(_as_dict(msg), sort_keys=True))


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else "-"


def _ago(seconds: float) -> str:
    if seconds < 0:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def render_status(h: pb.RunHealth, now: float, address: str = "") -> None:
    """The status table; `address`: where the daemon that answered was reached."""
    from rich.table import Table
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    if not h.job_id:
        _add(t, "run", "no job submitted")
    else:
        _add(t, "run", f"{h.job_name or '?'} ({h.job_id})  {h.state}  since "
                       f"{_clock(h.since)} ({_ago(now - h.since)} ago)")
        _add(t, "reason", h.reason or "-")
        _add(t, "round", f"{h.round}  members {', '.join(h.members) or '-'}  "
                         f"restarts {h.restarts}")
        if h.replicas:
            _add(t, "replicas", "; ".join(
                f"{r.replica}: {', '.join(r.members)} {r.state} since round {r.since_round}"
                for r in h.replicas))
        total = f"/{h.total_steps}" if h.total_steps else ""
        _add(t, "step", f"{h.step}{total}  loss {h.loss:.4f}  {h.tokens_per_s:,.0f} tok/s  "
                        f"{h.step_time_s:.3f} s/step" if not h.steps_unknown else
                        script_progress(h))
        _add(t, "goodput", "-" if h.goodput < 0 else
                f"{h.goodput:.1%} ({h.productive_time_s:.0f} s of {h.wall_time_s:.0f} s)")
    _add(t, "nodes", ", ".join(f"{k} {v}" for k, v in sorted(h.nodes_by_state.items())) or "none")
    if h.HasField("last_checkpoint"):
        c = h.last_checkpoint
        good = "" if c.good else " (not yet good)"
        _add(t, "checkpoint", f"step {c.step}{good} at {_clock(c.committed_at)}  {c.path}")
        if not c.good and h.HasField("last_good_checkpoint"):
            _add(t, "good", f"step {h.last_good_checkpoint.step}")
    else:
        _add(t, "checkpoint", "none committed")
    if h.HasField("incident"):
        i = h.incident
        _add(t, "incident", f"{i.kind} on {i.culprit or '?'} (round {i.round}, "
                            f"{_ago(now - i.fault_at)} ago): {i.reason}")
    if h.paused:
        _add(t, "paused", "a pause command is in force (lazarus resume)")
    if h.draining:
        _add(t, "draining", ", ".join(h.draining))
    _add(t, "leader", f"{h.leader.id} at {h.leader.api or '(no API)'}"
         if h.HasField("leader") else "none")
    who = f"{'leader' if h.served_by_leader else 'standby'} {h.served_by}"
    _add(t, "answered", f"{address} ({who})" if address else who)
    _console().print(t)


def script_progress(h: pb.RunHealth) -> str:
    """The step line of a script that reports no steps (level 0): what is known of it, not
    zeros that would read as a run stuck at step 0."""
    issued = ("no collective reported yet" if h.collectives < 0 else
              f"{h.collectives:,} collectives"
              + (f"  {h.collectives_per_s:,.1f}/s" if h.collectives_per_s > 0 else "")
              + (f"  last {_ago(h.last_collective_age_s)} ago"
                 if h.last_collective_age_s >= 0 else ""))
    return (f"unknown (the script does not report steps)  round {h.round}  "
            f"{h.ranks_joined}/{h.world_size} ranks joined  {issued}")


def render_nodes(nodes: list[pb.Node]) -> None:
    from rich.table import Table
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col, just in (("NODE", "left"), ("ROLE", "left"), ("STATE", "left"),
                      ("RANKS", "left"), ("STEP", "right"), ("STEP/S", "right"),
                      ("TOK/S", "right"), ("LOSS", "right"), ("HEALTH", "left"),
                      ("MEMORY", "right"), ("REPORTED", "right"), ("LEASE", "right"),
                      ("HOST", "left")):
        t.add_column(col, justify=just, no_wrap=True)
    for n in nodes:
        ranks = ",".join(map(str, n.ranks)) or "-"
        flags = "".join([" (cordoned)" if n.cordoned and n.state != "cordoned" else "",
                         " (draining)" if n.draining else ""])
        sick = [f"{v.monitor} {v.state}" + (f": {v.reasons[0]}" if v.reasons else "")
                for v in n.health if v.state != "healthy"]
        _add(t, n.node, n.role or "-", n.state + flags, ranks, str(n.step),
                f"{n.step_rate:.2f}", f"{n.tokens_per_s:,.0f}", f"{n.loss:.4f}",
                "; ".join(sick) or ("ok" if n.health else "-"),
                (f"{n.tier0_bytes / 2**20:,.1f}/{n.tier0_limit_bytes / 2**20:,.0f} MiB"
                 if n.tier0_limit_bytes else "-"),
                f"{_ago(n.last_report_age_s)} ago" if n.last_report_age_s >= 0 else "-",
                f"{n.lease_ttl_s} s" if n.registered else "expired", n.host or "-")
    _console().print(t)
    # Below the table, not in it: a reason is a sentence, and a row must fit the terminal.
    for n in nodes:
        if n.cordoned and n.cordon_reason:
            _console().print(printable(f"{n.node} cordoned: {' '.join(n.cordon_reason.split())}"),
                             markup=False, highlight=False)


def render_checkpoints(cks: list[pb.Checkpoint]) -> None:
    from rich.table import Table
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col, just in (("STEP", "right"), ("ROUND", "right"), ("GOOD", "left"),
                      ("COMMITTED", "left"), ("PATH", "left")):
        t.add_column(col, justify=just, no_wrap=True)
    for c in cks:
        _add(t, str(c.step), str(c.round), "yes" if c.good else "no", _clock(c.committed_at),
                c.path)
    _console().print(t)


def event_line(ev: pb.Event) -> str:
    return printable(f"{_clock(ev.time)}  {ev.kind:<15} {ev.message}")


# -- commands ----------------------------------------------------------------------------------
def _run(prog: str, argv: list[str], add_args: Callable[[argparse.ArgumentParser], None],
         body: Callable[[argparse.Namespace, Target], int], description: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_args(p)
    _common(p)
    args = p.parse_args(argv)
    try:
        return body(args, target(args))
    except Failed as e:
        print(printable(f"{prog}: error: {e}"), file=sys.stderr)
        return e.code


def _none(p: argparse.ArgumentParser) -> None:
    pass


def status_main(argv: list[str]) -> int:
    def body(args, target):
        address, h = call_at(target, "GetRunHealth", pb.GetRunHealthRequest())
        if args.json:
            _print_json(h)
        else:
            render_status(h, time.time(), address)
        return 0
    return _run("lazarus status", argv, _none, body, "the run's health at a glance")


def nodes_main(argv: list[str]) -> int:
    def body(args, target):
        reply = call(target, "ListNodes", pb.ListNodesRequest())
        if args.json:
            _print_json(reply)
        else:
            render_nodes(list(reply.nodes))
        return 0
    return _run("lazarus nodes", argv, _none, body, "the nodes, their roles and progress")


def checkpoints_main(argv: list[str]) -> int:
    def add(p):
        p.add_argument("--limit", type=int, default=0, help="only the newest N")

    def body(args, target):
        reply = call(target, "ListCheckpoints", pb.ListCheckpointsRequest(limit=args.limit))
        if args.json:
            _print_json(reply)
        else:
            render_checkpoints(list(reply.checkpoints))
        return 0
    return _run("lazarus checkpoints", argv, add, body, "committed checkpoints, oldest first")


def events_main(argv: list[str]) -> int:
    def add(p):
        p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
        p.add_argument("--kind", action="append", default=[],
                       help="only events of this kind (repeatable)")
        p.add_argument("--since-revision", type=int, default=0,
                       help="from this etcd revision on (an event's revision + 1 resumes)")

    def body(args, target):
        req = pb.WatchEventsRequest(start_revision=args.since_revision, kinds=args.kind,
                                    follow=args.follow)
        for ev in stream_events(target, req):
            print(json.dumps(_as_dict(ev), sort_keys=True) if args.json else event_line(ev),
                  flush=True)
        return 0
    return _run("lazarus events", argv, add, body, "the run's events (state changes and why)")


def _command(prog: str, argv: list[str], description: str, method: str,
             make_request: Callable[[argparse.Namespace], object],
             add_args: Callable[[argparse.ArgumentParser], None] = _none) -> int:
    def body(args, target):
        reply = call(target, method, make_request(args))
        if args.json:
            _print_json(reply)
        else:
            print(printable(reply.message))
        return 0
    return _run(prog, argv, add_args, body, description)


def _node_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("node", help="node id")


def checkpoint_main(argv: list[str]) -> int:
    def add(p):
        p.add_argument("what", choices=["now"], help="`now`: checkpoint at the next step")
        p.add_argument("--reason", default="", help="noted with the request")
    return _command("lazarus checkpoint", argv, "ask for a checkpoint now",
                    "TriggerCheckpoint", lambda a: pb.TriggerCheckpointRequest(reason=a.reason),
                    add)


def drain_main(argv: list[str]) -> int:
    return _command("lazarus drain", argv, "checkpoint, then swap a spare in for NODE",
                    "DrainNode", lambda a: pb.DrainNodeRequest(node=a.node), _node_arg)


def cordon_main(argv: list[str]) -> int:
    return _command("lazarus cordon", argv, "NODE takes no new work", "CordonNode",
                    lambda a: pb.CordonNodeRequest(node=a.node), _node_arg)


def uncordon_main(argv: list[str]) -> int:
    return _command("lazarus uncordon", argv, "NODE may take work again", "UncordonNode",
                    lambda a: pb.UncordonNodeRequest(node=a.node), _node_arg)


def pause_main(argv: list[str]) -> int:
    def add(p):
        p.add_argument("--reason", default="", help="noted with the request")
    return _command("lazarus pause", argv, "pause the run after a checkpoint", "PauseRun",
                    lambda a: pb.PauseRunRequest(reason=a.reason), add)


def resume_main(argv: list[str]) -> int:
    return _command("lazarus resume", argv, "resume a paused run", "ResumeRun",
                    lambda a: pb.ResumeRunRequest())


def cancel_main(argv: list[str]) -> int:
    def add(p):
        p.add_argument("--job-id", default="", help="refuse unless this is the current job")
    return _command("lazarus cancel", argv, "end the current run as CANCELLED", "CancelJob",
                    lambda a: pb.CancelJobRequest(job_id=a.job_id), add)
