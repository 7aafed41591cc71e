"""The operator API (proto/lazarus/v1/lazarus.proto), served by every daemon.

Reads come from the daemon's cached view of etcd (daemon.view.LiveView; every daemon, leader
or standby, keeps one current from a watch), first brought up to etcd's current revision, so a
standby answers like the leader and names it, and a read sees every write made before it. Commands are etcd writes on the keys of lazarus.core.records (cordon/, commands/...);
the leader's reconcile loop acts on them. Nothing here holds state of the run.

Three roles, each a bearer token: the admin token may call every RPC; the read-only token only
READ_METHODS (run health, nodes, checkpoints, events); the submit token, a user's, those and
SUBMIT_METHODS (submit and cancel a job), so that users run jobs without the daemons' etcd
credentials or the operators' commands. Any other call with a lesser token ends
PERMISSION_DENIED before its request is parsed. A method not listed needs the admin token, so
an RPC added later is an admin's until someone decides otherwise.

A client cannot hurt the daemon: requests over MAX_REQUEST_BYTES are refused by gRPC before
they are parsed, every field is checked (INVALID_ARGUMENT names it), at most MAX_STREAMS event
streams run at once so unary calls always find a thread, a refused call ends without waiting
for its request (a caller that never sends one holds no thread), a follow stream whose reader
falls MAX_INBOX_EVENTS behind ends RESOURCE_EXHAUSTED instead of growing without bound, and
an error in a handler ends that call only (gRPC turns it into a status). docs/security.md.
"""

from __future__ import annotations

import collections
import hmac
import logging
import threading
import time
import tomllib
import uuid
from concurrent import futures
from pathlib import Path

import grpc

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.daemon import health
from lazarus.daemon.history import History, merged_events
from lazarus.daemon.view import ClusterView, LiveView
from lazarus.core.errors import UserError
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.proto.lazarus.v1 import lazarus_pb2_grpc as pb_grpc
from lazarus.core.records import (TERMINAL, EventRecord, Keys, RecordError, RunStatus, dumps,
                             writer_id)

log = logging.getLogger("lazarus.api")

MAX_REQUEST_BYTES = 256 * 1024
MAX_REPLY_BYTES = 64 * 1024 * 1024
MAX_JOB_TOML_BYTES = 64 * 1024
MAX_STREAMS = 8
MAX_KINDS, MAX_KIND_LEN = 32, 64
MAX_NODE_LEN = 253
MAX_REASON_LEN = 256
MAX_CHECKPOINT_LIMIT = 100_000
# What the read-only token may call: everything that changes nothing.
READ_METHODS = frozenset({"GetRunHealth", "ListNodes", "ListCheckpoints", "WatchEvents"})
# What the submit token may call besides: a user's own job, not the operators' commands
# (drain, cordon, pause, checkpoint).
SUBMIT_METHODS = READ_METHODS | {"SubmitJob", "CancelJob"}
# How often a quiet event stream looks whether its client is still there.
STREAM_POLL_S = 1.0
# Events a follow stream may hold for a reader that does not keep up; past them it ends
# RESOURCE_EXHAUSTED, naming the revision to watch again from. Above what a re-list after a
# compaction brings at once (retention keeps 1000 events by default).
MAX_INBOX_EVENTS = 10_000
# How long a read waits for the cache to catch up with etcd; a change outside our key root
# moves etcd's revision without ever reaching our watch, and costs a read that much.
CATCH_UP_S = 0.5


class _QuietUnparsable(logging.Filter):
    """gRPC logs a traceback for every request it cannot parse (the caller gets INTERNAL);
    left on, any client could flood the daemon's log with garbage."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Exception deserializing message!"


logging.getLogger("grpc._common").addFilter(_QuietUnparsable())


class _Refused(Exception):
    """A request the API turns down: (status code, message)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> _Refused:
    return _Refused(grpc.StatusCode.INVALID_ARGUMENT, message)


def _precondition(message: str) -> _Refused:
    return _Refused(grpc.StatusCode.FAILED_PRECONDITION, message)


def _node_name(value: str) -> str:
    if not value:
        raise _invalid("node: required")
    if len(value) > MAX_NODE_LEN or "/" in value or not value.isprintable():
        raise _invalid(f"node: {value[:80]!r} is not a node id (printable, no '/', at most "
                       f"{MAX_NODE_LEN} characters)")
    return value


def _text(field: str, value: str, limit: int) -> str:
    if len(value) > limit or not value.isprintable():
        raise _invalid(f"{field}: at most {limit} printable characters")
    return value


class _FellBehind(Exception):
    """A follow stream's reader let more than its inbox's limit of events pile up."""


class _Inbox:
    """The batches of events a follow stream has yet to send, at most `limit` events: the
    watch fills it from etcd's pace, the stream empties it at its reader's, and a reader that
    never reads must not make the daemon hold every event of the run for it. Past the limit
    the inbox drops what it holds and takes nothing more; `get` then raises _FellBehind."""

    def __init__(self, limit: int):
        self._limit = limit
        self._batches: collections.deque[list] = collections.deque()
        self._pending = 0
        self._behind = False
        self._cond = threading.Condition()

    def put(self, batch: list) -> None:
        with self._cond:
            if self._behind:
                return
            self._pending += len(batch)
            if self._pending > self._limit:
                self._behind = True
                self._batches.clear()
                self._pending = 0
            else:
                self._batches.append(batch)
            self._cond.notify()

    def get(self, timeout: float) -> list | None:
        """The next batch, or None when none came within `timeout`."""
        with self._cond:
            if not self._batches and not self._behind:
                self._cond.wait(timeout)
            if self._behind:
                raise _FellBehind()
            if not self._batches:
                return None
            batch = self._batches.popleft()
            self._pending -= len(batch)
            return batch


def _unary(method):
    """Refusals and etcd outages become statuses; the call ends, the server goes on."""
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except _Refused as e:
            context.abort(e.code, str(e))
        except E.EtcdUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unreachable from the daemon: {e}")
    wrapper.__name__ = method.__name__
    return wrapper


class LazarusServicer(pb_grpc.LazarusServicer):
    """`views`: the cached view reads come from (the daemon's own); `history`: the daemon's
    archive of what retention moved out of etcd; events are served from it and etcd
    together."""

    def __init__(self, etcd: E.Etcd, keys: Keys, *, served_by: str, views: LiveView,
                 max_streams: int = MAX_STREAMS, history: History | None = None):
        self.etcd = etcd
        self.keys = keys
        self.served_by = served_by
        self.views = views
        self.history = history
        self._max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams)

    def _view(self) -> ClusterView:
        return self.views.fresh(CATCH_UP_S)

    def _status(self) -> RunStatus | None:
        kv = self.etcd.get(self.keys.status)
        if kv is None:
            return None
        try:
            return RunStatus.from_json(kv.value, self.keys.status)
        except RecordError:
            raise _precondition("run/status is unreadable; the daemon is repairing it") from None

    def _active_run(self) -> RunStatus:
        st = self._status()
        if st is None or st.state in TERMINAL:
            raise _precondition("no run is active" + (f" (the last one {st.state})" if st else ""))
        return st

    # -- reads ---------------------------------------------------------------------------------
    @_unary
    def GetRunHealth(self, request, context):
        view = self._view()
        return health.run_health(view, now=time.time(), served_by=self.served_by,
                                 all_events=health.with_history(self.history, view))

    @_unary
    def ListNodes(self, request, context):
        view = self._view()
        return pb.ListNodesResponse(nodes=health.list_nodes(view, now=time.time()),
                                    revision=view.revision)

    @_unary
    def ListCheckpoints(self, request, context):
        if not 0 <= request.limit <= MAX_CHECKPOINT_LIMIT:
            raise _invalid(f"limit: must be 0..{MAX_CHECKPOINT_LIMIT}, got {request.limit}")
        return pb.ListCheckpointsResponse(
            checkpoints=health.list_checkpoints(self._view(), limit=request.limit))

    def WatchEvents(self, request, context):
        try:
            if request.start_revision < 0:
                raise _invalid(f"start_revision: must be >= 0, got {request.start_revision}")
            if len(request.kinds) > MAX_KINDS:
                raise _invalid(f"kinds: at most {MAX_KINDS}, got {len(request.kinds)}")
            for kind in request.kinds:
                _text("kinds", kind, MAX_KIND_LEN)
            if not self._streams.acquire(blocking=False):
                raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this daemon already serves {self._max_streams} event streams")
        except _Refused as e:
            context.abort(e.code, str(e))
        try:
            context.send_initial_metadata(())  # the client knows the stream is established
            yield from self._events(request, context)
        except E.EtcdUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd unreachable from the daemon: {e}")
        finally:
            self._streams.release()

    def _events(self, request, context):
        kinds = set(request.kinds)
        last = request.start_revision - 1  # highest revision delivered

        def wanted(kv: E.KV) -> pb.Event | None:
            if kv.mod_revision <= last:
                return None
            try:
                ev = EventRecord.from_json(kv.value, kv.key)
                msg = health.event_message(kv, ev)
            except (RecordError, ValueError, TypeError):
                return None
            return msg if not kinds or ev.kind in kinds else None

        snap = self.etcd.get_prefix(self.keys.events)
        backlog = [kv for kv, _ in merged_events(self.history, snap, self.keys)]
        if request.follow:
            inbox = _Inbox(MAX_INBOX_EVENTS)

            def resync() -> int:  # the watch fell behind a compaction: re-list what is left
                again = E.retry(lambda: self.etcd.get_prefix(self.keys.events), deadline_s=30)
                inbox.put([E.Event(kind="PUT", kv=again.kvs[k]) for k in sorted(again.kvs)])
                return again.revision + 1

            watch = self.etcd.watch_prefix(
                self.keys.events, start_revision=max(snap.revision + 1, request.start_revision),
                on_events=inbox.put, on_resync=resync)
            context.add_callback(watch.cancel)
        try:
            for kv in backlog:
                msg = wanted(kv)
                if msg is not None:
                    last = max(last, kv.mod_revision)
                    yield msg
            if not request.follow:
                return
            while context.is_active():
                try:
                    batch = inbox.get(timeout=STREAM_POLL_S)
                except _FellBehind:
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"this stream fell more than {MAX_INBOX_EVENTS} events behind "
                                  "(its reader is too slow); watch again with start_revision "
                                  f"{last + 1} to go on from where it stopped")
                if batch is None:
                    continue
                for ev in batch:
                    if "DELETE" in ev.kind:
                        continue
                    msg = wanted(ev.kv)
                    if msg is not None:
                        last = max(last, ev.kv.mod_revision)
                        yield msg
        finally:
            if request.follow:
                watch.cancel()

    # -- commands ------------------------------------------------------------------------------
    def _put(self, key: str, doc: dict) -> int:
        return self.etcd.put(key, dumps(doc))

    @_unary
    def TriggerCheckpoint(self, request, context):
        reason = _text("reason", request.reason, MAX_REASON_LEN)
        self._active_run()
        rid = uuid.uuid4().hex[:12]
        rev = self._put(self.keys.checkpoint_request,
                        {"id": rid, "requested_at": time.time(), "reason": reason})
        return pb.CommandReply(message=f"checkpoint requested (id {rid}); the workers save at "
                                       "their next step boundary", revision=rev, id=rid)

    def _registered(self, node: str) -> None:
        if self.etcd.get(self.keys.node_key(node)) is None:
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"node {node!r} is not registered")

    @_unary
    def DrainNode(self, request, context):
        node = _node_name(request.node)
        self._registered(node)
        st = self._active_run()
        if node not in st.members:
            raise _precondition(f"node {node!r} is not a member of round {st.round}; "
                                "cordon it to keep work off it")
        rev = self._put(self.keys.drain_key(node), {"requested_at": time.time()})
        return pb.CommandReply(message=f"draining {node}: checkpoint, then a new round "
                                       "without it", revision=rev)

    @_unary
    def CordonNode(self, request, context):
        node = _node_name(request.node)
        self._registered(node)
        rev = self._put(self.keys.cordon_key(node), {"requested_at": time.time()})
        return pb.CommandReply(message=f"cordoned {node}: it takes no new work", revision=rev)

    @_unary
    def UncordonNode(self, request, context):
        node = _node_name(request.node)
        if self.etcd.get(self.keys.cordon_key(node)) is None:
            return pb.CommandReply(message=f"{node} was not cordoned")
        self.etcd.delete(self.keys.cordon_key(node))
        return pb.CommandReply(message=f"uncordoned {node}")

    @_unary
    def PauseRun(self, request, context):
        reason = _text("reason", request.reason, MAX_REASON_LEN)
        st = self._active_run()
        if self.etcd.get(self.keys.pause) is not None:
            return pb.CommandReply(message=f"run {st.job_id} is already pausing or paused")
        rev = self._put(self.keys.pause, {"requested_at": time.time(), "reason": reason,
                                          "job_id": st.job_id})
        return pb.CommandReply(message=f"pausing run {st.job_id} after a checkpoint",
                               revision=rev)

    @_unary
    def ResumeRun(self, request, context):
        if self.etcd.get(self.keys.pause) is None:
            return pb.CommandReply(message="the run was not paused")
        self.etcd.delete(self.keys.pause)
        return pb.CommandReply(message="resuming the run from its last checkpoint")

    @_unary
    def SubmitJob(self, request, context):
        text = request.job_toml
        if not text.strip():
            raise _invalid("job_toml: required (the text of a job file)")
        if len(text.encode()) > MAX_JOB_TOML_BYTES:
            raise _invalid(f"job_toml: at most {MAX_JOB_TOML_BYTES} bytes")
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise _invalid(f"job_toml: not valid TOML: {e}") from None
        try:
            spec = jobspec.from_dict(doc, source="job_toml")
        except UserError as e:
            raise _invalid(str(e)) from None
        st = self._status()
        if st is not None and st.state not in TERMINAL:
            raise _precondition(f"run {st.job_id} is {st.state}; cancel it first")
        rev = self.etcd.put(self.keys.job, spec.to_json())
        return pb.SubmitJobReply(job_id=spec.id, revision=rev,
                                 message=f"submitted job {spec.name!r} ({spec.id}): "
                                         f"{spec.nodes} node(s) x {spec.nproc_per_node} rank(s)")

    @_unary
    def CancelJob(self, request, context):
        job_id = _text("job_id", request.job_id, 64)
        st = self._active_run()
        if job_id and job_id != st.job_id:
            raise _precondition(f"job {job_id} is not the current run (that is {st.job_id})")
        rev = self._put(self.keys.cancel, {"requested_at": time.time(), "job_id": st.job_id})
        return pb.CommandReply(message=f"cancelling run {st.job_id}", revision=rev)


class TokenAuth(grpc.ServerInterceptor):
    """Every call must carry `authorization: Bearer TOKEN`, the admin token, the submit one for
    SUBMIT_METHODS or the read-only one for READ_METHODS; others end UNAUTHENTICATED (no or an
    unknown token) or PERMISSION_DENIED (a lesser token on a command it may not call) before
    their request is parsed."""

    def __init__(self, token: str, read_token: str | None = None,
                 submit_token: str | None = None):
        self._admin = f"Bearer {token}".encode()
        self._read = f"Bearer {read_token}".encode() if read_token else None
        self._submit = f"Bearer {submit_token}".encode() if submit_token else None

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        # Both compared every time: how long a refusal takes says nothing of which token
        # came close.
        admin = hmac.compare_digest(given, self._admin)
        reader = self._read is not None and hmac.compare_digest(given, self._read)
        submitter = self._submit is not None and hmac.compare_digest(given, self._submit)
        if admin:
            return handler
        method = details.method.rpartition("/")[2]
        if reader or submitter:
            allowed, kind = (SUBMIT_METHODS, "a submit token") if submitter else (
                READ_METHODS, "read-only")
            if method in allowed:
                return handler
            needs = ("the submit or admin token" if method in SUBMIT_METHODS
                     else "the admin token")
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"{method} needs {needs}; this token is {kind} (it may "
                         f"call {', '.join(sorted(allowed))})")
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED,
                     "missing or wrong bearer token" if given else
                     "missing bearer token (authorization metadata)")


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
          message: str) -> grpc.RpcMethodHandler:
    # Handlers that take a request *stream*, whatever the method's shape: gRPC calls them at
    # once, where a unary-request handler first waits in a pool thread for the whole request.
    # A caller that sends headers and never its request would hold a thread each that way, and
    # a score of them every thread the server has. The wire does not tell the two apart.
    # No deserializer either: a refused call's bytes are never parsed.
    def unary(_requests, context):
        context.abort(code, message)

    def stream(_requests, context):
        context.abort(code, message)
        yield  # a generator, like the handler it stands in for

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    return grpc.stream_unary_rpc_method_handler(unary)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{what} {path!r} is unreadable ({e.strerror})") from None


def serve(etcd: E.Etcd, keys: Keys, *, address: str, token: str | None = None,
          read_token: str | None = None, submit_token: str | None = None,
          tls_cert: str | None = None, tls_key: str | None = None,
          client_ca: str | None = None, served_by: str | None = None,
          max_streams: int = MAX_STREAMS, history: History | None = None,
          views: LiveView | None = None) -> tuple[Server, int]:
    """Start the API on `address` (HOST:PORT; port 0 = any free port); returns the started
    server and the port it bound. token None = no authentication; `read_token`, beside the
    admin `token`, may call READ_METHODS only; `submit_token`, SUBMIT_METHODS. TLS when
    tls_cert and tls_key are given; with client_ca, clients must present a certificate it
    signed.
    `views`: the daemon's cached view; without one the server keeps its own."""
    if read_token is not None and token is None:
        raise UserError("a read-only token needs an admin token beside it (--token-file or "
                        "LAZARUS_TOKEN)")
    if read_token is not None and read_token == token:
        raise UserError("the read-only token is the admin token; give the readers a token "
                        "of their own")
    if submit_token is not None and token is None:
        raise UserError("a submit token needs an admin token beside it (--token-file or "
                        "LAZARUS_TOKEN)")
    if submit_token is not None and submit_token in (token, read_token):
        other = "admin" if submit_token == token else "read-only"
        raise UserError(f"the submit token is the {other} token; give the users a token of "
                        "their own")
    if (tls_cert is None) != (tls_key is None):
        raise UserError("TLS needs both --tls-cert and --tls-key")
    if client_ca is not None and tls_cert is None:
        raise UserError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    options = [("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
               ("grpc.max_send_message_length", MAX_REPLY_BYTES),
               # gRPC binds with SO_REUSEPORT by default: a second daemon on the same port
               # would silently share it instead of failing.
               ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + 8,
                                                    thread_name_prefix="api"),
                         interceptors=([TokenAuth(token, read_token, submit_token)]
                                       if token else []),
                         options=options, maximum_concurrent_rpcs=4 * (max_streams + 8))
    own = views is None
    if views is None:
        views = LiveView(etcd, keys)  # lists etcd at the first read
    pb_grpc.add_LazarusServicer_to_server(
        LazarusServicer(etcd, keys, served_by=served_by or writer_id(), views=views,
                        max_streams=max_streams, history=history), server)
    try:
        if tls_cert is not None:
            creds = grpc.ssl_server_credentials(
                [(_read(tls_key, "--tls-key"), _read(tls_cert, "--tls-cert"))],
                root_certificates=_read(client_ca, "--tls-client-ca") if client_ca else None,
                require_client_auth=client_ca is not None)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise UserError(f"--api {address}: cannot listen there ({e}); is the port taken? "
                        "(port 0 picks a free one)") from None
    if port == 0:
        raise UserError(f"--api {address}: cannot listen there")
    server.start()
    return Server(server, views if own else None), port


class Server:
    """The started gRPC server; stopping it also stops the cache it keeps, if it keeps one."""

    def __init__(self, server: grpc.Server, views: LiveView | None):
        self.grpc = server
        self._views = views

    def stop(self, grace: float | None):
        """Like grpc.Server.stop: returns an event set once the server has stopped."""
        if self._views is not None:
            self._views.stop()
        return self.grpc.stop(grace)
