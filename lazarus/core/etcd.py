"""Our one etcd v3 client per process: a synchronous face on `aetcd`.

aetcd is asyncio-only and opens a gRPC channel per client; two gRPC etcd clients in one
process also clash in protobuf's descriptor pool (docs/constraints.md, "etcd and its
clients"). So each process owns exactly one `Etcd`, which runs aetcd on a private event loop
thread, and the daemon, the agent and the torchrun rendezvous backend call it synchronously.

What lives here and nowhere else:
- several members (`--etcd a:2379,b:2379,c:2379`): one gRPC channel at a time, to one
  member; when that member fails (down, or cut off from its quorum) the client closes it and
  moves to the next, within the same call;
- every etcd error mapped onto one type of ours (`EtcdUnavailable` and its kinds: no leader,
  out of space, answer too large, revision compacted, refused), so that a loop that catches
  `EtcdUnavailable` survives them all, and `OutageLog` says each once;
- retries with backoff (`retry`), for idempotent reads and for writes guarded by a compare;
- consistent snapshots: several prefixes read at one revision, paged when large;
- fenced writes: `txn` with compares, used for every write a leader or a round owner makes;
- sessions: a lease with a background keep-alive (aetcd has none) and a "lost" callback;
- watches that resume from the last seen revision + 1, and re-list after a compaction or a
  broken stream (the callback is told to resync);
- TLS and etcd authentication (lazarus.core.etcd_auth says what a client is given): aetcd
  opens plaintext channels only, so `_Client` opens its own, and authenticates again when
  etcd forgets its token (a restarted member forgets them all, an idle one forgets it after
  --auth-token-ttl): calls retry with the new token, watches are created again on a watch
  stream that carries it (lazarus.core.etcd_watcher).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

# We fork worker processes while gRPC threads run; gRPC's fork handlers only add noise then.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aetcd  # noqa: E402
import aetcd.exceptions as aexc  # noqa: E402
import grpc.aio  # noqa: E402
from aetcd import rpc  # noqa: E402
from aetcd.utils import prefix_range_end  # noqa: E402

from lazarus.core.errors import UserError  # noqa: E402
from lazarus.core.etcd_auth import PASSWORD_ENV, EtcdAuth  # noqa: E402
from lazarus.core.etcd_watcher import StreamRenewed, WatchCanceled, Watcher  # noqa: E402

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- errors ------------------------------------------------------------------------------------
class EtcdUnavailable(ConnectionError):
    """etcd did not serve the request (down, partitioned, restarting, refusing). Retry later.

    `member_fault`: another member may serve it, so the client moves on to the next one."""

    member_fault = True


class EtcdNoLeader(EtcdUnavailable):
    """The member has no leader: its quorum is lost, or an election is under way."""


class EtcdNoSpace(EtcdUnavailable):
    """etcd's NOSPACE alarm: the database reached its quota and every member refuses writes
    (reads, deletes, lease keep-alives and compaction still work) until an operator compacts,
    defragments and disarms the alarm (docs/operations.md)."""

    member_fault = False


class EtcdTooLarge(EtcdUnavailable):
    """An answer exceeded gRPC's receive limit (4 MiB): the read must be paged."""

    member_fault = False


class EtcdCompacted(EtcdUnavailable):
    """The revision asked for was compacted away: re-list at the current one."""

    member_fault = False


class EtcdRefused(EtcdUnavailable):
    """Any other error etcd answered with (a request too large, permission denied): retrying
    on another member will not help, and the caller's loop must not die of it either."""

    member_fault = False


class EtcdPermissionDenied(EtcdRefused):
    """etcd's RBAC refused the request: the user we authenticate as has no right to it."""


class EtcdTokenExpired(EtcdUnavailable):
    """etcd no longer knows our auth token (it expired, or the member restarted): the
    client authenticates again and retries."""

    member_fault = False


class EtcdTLSError(EtcdUnavailable):
    """The TLS handshake with a member failed: a certificate that does not match. Another
    member may have a good one; no retry mends this one."""


class EtcdAuthFailed(UserError):
    """etcd refused our user name or password: a mistake in what we were given, not an
    outage, so no loop retries it."""


class LeaseLost(RuntimeError):
    """etcd no longer knows the lease a write named: its owner's session is over."""


_NO_LEADER = ("no leader", "leader changed", "leader fail", "request timed out")


def classify(error: BaseException, member: str, auth: EtcdAuth | None = None
             ) -> Exception | None:
    """An error raised by an aetcd or gRPC call -> our type for it; None when it is not an
    etcd error at all (a bug of ours, raised as it is). `auth` (what the client was given)
    makes the messages of TLS and permission errors say what to change."""
    if isinstance(error, (EtcdUnavailable, LeaseLost, EtcdAuthFailed)):
        return error
    if isinstance(error, aexc.RevisionCompactedError):
        return EtcdCompacted(f"etcd revision was compacted below {error.compacted_revision}")
    cause = error if isinstance(error, rpc.AioRpcError) else error.__cause__
    if isinstance(cause, rpc.AioRpcError):
        code, details = cause.code(), cause.details() or ""
    elif isinstance(error, WatchCanceled):
        code, details = error.code, error.details
    elif isinstance(error, aexc.ConnectionFailedError):
        code, details = rpc.StatusCode.UNAVAILABLE, str(error)
    elif isinstance(error, (aexc.ConnectionTimeoutError, aexc.WatchTimeoutError, TimeoutError,
                            asyncio.TimeoutError)):
        code, details = rpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time"
    elif isinstance(error, (asyncio.CancelledError, concurrent.futures.CancelledError,
                            grpc.aio.UsageError)):
        # our own switch to another member closed the channel under this call
        code, details = rpc.StatusCode.CANCELLED, "call cancelled"
    elif isinstance(error, aexc.ClientError):
        code, details = rpc.StatusCode.UNKNOWN, str(error)
    else:
        return None
    return _by_code(code, details, member, auth or EtcdAuth())


# What gRPC's details say of a failed handshake: the client rejected the server's
# certificate, or the server rejected ours (or that we sent none).
_SERVER_CERT_BAD = ("handshake failed", "CERTIFICATE_VERIFY_FAILED", "certificate signature")
_CLIENT_CERT_BAD = ("Unwrap failed", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED")


def _by_code(code, details: str, member: str, auth: EtcdAuth) -> Exception:
    S = rpc.StatusCode
    if code == S.UNAVAILABLE and auth.tls:
        if any(s in details for s in _SERVER_CERT_BAD):
            return EtcdTLSError(f"TLS handshake with etcd at {member} failed: is its server "
                                f"certificate signed by --etcd-ca and valid for {member}? "
                                f"({details})")
        if any(s in details for s in _CLIENT_CERT_BAD):
            return EtcdTLSError(f"etcd at {member} refused our TLS connection: it asks for a "
                                "client certificate signed by the CA it trusts (--etcd-cert, "
                                f"--etcd-key) ({details})")
    if code == S.UNAVAILABLE and not auth.tls and "Socket closed" in details:
        return EtcdUnavailable(f"etcd at {member} unavailable: {details} (if it serves TLS, "
                               "give --etcd-ca)")
    if code == S.UNAUTHENTICATED and "invalid auth token" in details:
        return EtcdTokenExpired(f"etcd at {member} no longer knows our auth token")
    # Without a token etcd takes the client certificate's name for the user: one that is no
    # user is "not found".
    if (code == S.PERMISSION_DENIED or "permission denied" in details
            or "user name is empty" in details or "user name not found" in details):
        who = (f"etcd user {auth.user!r} has no right to it" if auth.user else
               "no --etcd-user was given and etcd requires one")
        return EtcdPermissionDenied(f"etcd at {member} denied the request ({details}): {who}")
    if code == S.RESOURCE_EXHAUSTED:
        if "space exceeded" in details:
            return EtcdNoSpace("etcd is out of space (NOSPACE alarm): it refuses writes until "
                               "it is compacted, defragmented and the alarm disarmed "
                               "(docs/operations.md)")
        if "too many requests" in details:
            return EtcdUnavailable(f"etcd at {member} is overloaded: {details}")
        return EtcdTooLarge(f"an answer of etcd at {member} exceeded the client's receive "
                            f"limit: {details}")
    if code == S.UNAVAILABLE and any(s in details for s in _NO_LEADER):
        return EtcdNoLeader(f"etcd at {member} has no leader ({details}): its quorum is lost "
                            "or an election is under way")
    if code in (S.UNAVAILABLE, S.CANCELLED, S.INTERNAL, S.UNKNOWN):
        return EtcdUnavailable(f"etcd at {member} unavailable: {details}")
    if code == S.DEADLINE_EXCEEDED:
        return EtcdUnavailable(f"etcd at {member} unavailable: no answer in time")
    if code == S.OUT_OF_RANGE and "compacted" in details:
        return EtcdCompacted(f"etcd at {member}: {details}")
    if code == S.NOT_FOUND and "lease not found" in details:
        return LeaseLost(details)
    return EtcdRefused(f"etcd at {member} refused the request: {code.name}: {details}")


class OutageLog:
    """What a retrying loop says about etcd: one line when an outage starts, one when its kind
    changes (unreachable -> out of space), one when it ends. `consequence` tells the operator
    what goes on meanwhile ("workers keep training"). Out of space ends with the first write
    that goes through, not with a pass that only read."""

    def __init__(self, etcd: "Etcd", logger: logging.Logger, consequence: str):
        self._etcd = etcd
        self._log = logger
        self.consequence = consequence
        self.since: float | None = None
        self.kind: type | None = None

    def failed(self, error: EtcdUnavailable) -> None:
        if self.since is None:
            self.since = time.monotonic()
        if type(error) is not self.kind:
            self.kind = type(error)
            self._log.warning("%s; %s", error, self.consequence)

    def ok(self, *, writes_ok: bool | None = None) -> float | None:
        """A pass went through; returns how long etcd was away, if it was and is no more.
        `writes_ok`: whether etcd takes writes again, when the caller knows better than the
        client's last write (it has looked at the alarms)."""
        if writes_ok is None:
            writes_ok = not self._etcd.refusing_writes
        if self.since is None or (self.kind is EtcdNoSpace and not writes_ok):
            return None
        away = time.monotonic() - self.since
        self._log.info("etcd is back after %.1f s", away)
        self.since, self.kind = None, None
        return away


# -- records -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # "PUT" | "DELETE"
    kv: KV


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every key under the requested prefixes, read at one revision."""

    revision: int
    kvs: dict[str, KV]

    def prefix(self, prefix: str) -> dict[str, KV]:
        return {k: v for k, v in self.kvs.items() if k.startswith(prefix)}


@dataclass(frozen=True, slots=True)
class Alarm:
    member_id: int
    kind: str  # "NOSPACE" | "CORRUPT"


def _kv(raw) -> KV:
    return KV(key=raw.key.decode(), value=raw.value, create_revision=raw.create_revision,
              mod_revision=raw.mod_revision, version=raw.version, lease=raw.lease)


def _largest(kvs) -> int:
    """The largest key and value of a page of raw key-values, in bytes."""
    return max((len(raw.key) + len(raw.value) for raw in kvs), default=0)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' or 'http://host:port' -> (host, port); anything else is a UserError."""
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    host, sep, port = text.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"etcd endpoint {endpoint!r} is not HOST:PORT")
    return host, int(port)


def parse_endpoints(text: str) -> list[str]:
    """'a:2379,b:2379,c:2379' -> the members as 'host:port'; each must be HOST:PORT."""
    members = []
    for entry in text.split(","):
        try:
            host, port = parse_endpoint(entry)
        except UserError:
            if "," not in text:
                raise
            raise UserError(f"etcd endpoint {entry!r} (in {text!r}) is not HOST:PORT") from None
        members.append(f"{host}:{port}")
    if len(set(members)) != len(members):
        raise UserError(f"etcd endpoints {text!r} name a member twice")
    return members


# Compare builders for txn(): fenced writes compare a key's create revision (a leader's
# epoch) or value (the current round).
def create_revision_is(key: str, revision: int):
    return aetcd.transactions.Create(key.encode()) == revision


def value_is(key: str, value: bytes):
    return aetcd.transactions.Value(key.encode()) == value


def key_missing(key: str):
    return aetcd.transactions.Version(key.encode()) == 0


def mod_revision_is(key: str, revision: int):
    return aetcd.transactions.Mod(key.encode()) == revision


def put_op(key: str, value: bytes, lease: int | None = None):
    return aetcd.transactions.Put(key.encode(), value, lease=lease)


def delete_op(key: str, *, prefix: bool = False, below: str | None = None):
    """Delete `key`; with `prefix`, every key under it; with `below`, every key from `key`
    up to (not including) `below`."""
    k = key.encode()
    end = prefix_range_end(k) if prefix else below.encode() if below is not None else None
    return aetcd.transactions.Delete(k, range_end=end)


# -- the client --------------------------------------------------------------------------------
# gRPC backs off reconnects exponentially up to 2 minutes by default; after a long etcd outage
# the client would then sit out many seconds after etcd is back, longer than a lease TTL, and
# every lease would lapse. Reconnect attempts stay at most a second apart instead.
# The most one answer may hold (gRPC's default, named: the pages below are sized by it).
MAX_RECEIVE = 4 << 20
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.max_receive_message_length": MAX_RECEIVE,
}
# etcd's "require leader" request metadata (clientv3.WithRequireLeader).
_REQUIRE_LEADER = (("hasleader", "true"),)
# Keys per page of a range; a larger prefix is read in several, at one revision. 1,000 node
# statuses of ~1.4 KB fit well under MAX_RECEIVE. etcd bounds values, not pages: a key and
# its value are at most its --max-request-bytes (default 1.5 MiB; a put carries both), so a
# page of SAFE_PAGE_KEYS (2) fits one answer whatever the keys hold. A range's first page is
# sized by the largest value it held when last read (half an answer's worth), the next ones
# by the last page's; a page that does not fit is read again as a safe one.
PAGE_KEYS = 1000
MAX_KV_BYTES = (3 << 19) + 1024
SAFE_PAGE_KEYS = MAX_RECEIVE // MAX_KV_BYTES


class _Client(aetcd.Client):
    """aetcd's client over a channel of ours: TLS when `auth` has a CA, and a token of etcd's
    authentication when it has a user. Its requests and watches all ask for a member with a
    leader: a member cut off from its quorum then answers "no leader" at once, and ends its
    watches, instead of letting reads and lease refreshes hang until their deadline. Either
    way the `Etcd` above moves on to another member."""

    _auth_off_said = False  # once per process: etcd has authentication off, our user unused

    def __init__(self, *, host: str, port: int, auth: EtcdAuth, timeout: float,
                 options: dict):
        super().__init__(host=host, port=port, timeout=timeout, options=options)
        self.auth = auth
        self.member = f"{host}:{port}"
        self._auth_lock = asyncio.Lock()

    async def connect(self) -> None:
        # aetcd's own connect opens a plaintext channel only; this is it with TLS added.
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            target, options = f"{self._host}:{self._port}", list(self._options.items())
            if self.auth.tls:
                creds = grpc.ssl_channel_credentials(self.auth.ca, self.auth.key, self.auth.cert)
                self.channel = grpc.aio.secure_channel(target, creds, options=options)
            else:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            self.auth_stub = rpc.AuthStub(self.channel)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            # aetcd sends these metadata with every request and watch stream.
            self.metadata = _REQUIRE_LEADER
            self._watcher = Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                    metadata=self.metadata)
            try:
                await self.authenticate()
            except BaseException:
                await self.channel.close()
                self._init_channel_attrs()
                raise
            self._connected.set()
        finally:
            self._is_connecting = False

    async def authenticate(self) -> None:
        """Get a (new) token for our user; without a user there is nothing to do."""
        if self.auth.user is None:
            return
        request = rpc.AuthenticateRequest(name=self.auth.user, password=self.auth.password)
        try:
            # Authenticating goes through etcd's raft log: a member without a leader must say
            # so at once, as for any other request, not hold it to its deadline.
            reply = await self.auth_stub.Authenticate(request, timeout=self._timeout,
                                                      metadata=_REQUIRE_LEADER)
        except rpc.AioRpcError as e:
            details = e.details() or ""
            if "authentication failed" in details:
                raise EtcdAuthFailed(
                    f"etcd at {self.member} refused user {self.auth.user!r}: wrong user name "
                    f"or password (--etcd-user; --etcd-password-file or {PASSWORD_ENV})"
                ) from None
            if "authentication is not enabled" in details:
                if not _Client._auth_off_said:
                    _Client._auth_off_said = True
                    log.warning("etcd at %s has authentication off: user %r is not used, and "
                                "anyone who reaches etcd can write our keys (docs/"
                                "operations.md, 'Securing etcd')", self.member, self.auth.user)
                return
            raise
        self.metadata = _REQUIRE_LEADER + (("token", reply.token),)
        self._watcher._metadata = self.metadata

    @property
    def token(self) -> str | None:
        return dict(self.metadata or ()).get("token")

    @property
    def watch_token(self) -> str | None:
        """The token the open watch stream carries."""
        return self._watcher.stream_token if self._watcher is not None else None

    async def renew_token(self, stale: str | None) -> None:
        """etcd refused the token `stale`: get a new one, unless another call has since, and
        reopen the watch stream if it still carries an old one. Calls and watches that all
        met the same restart of etcd thus authenticate once."""
        async with self._auth_lock:
            if stale is not None and stale == self.token:
                await self.authenticate()
            if self._watcher is not None:
                await self._watcher.renew()


class Etcd:
    """A synchronous etcd v3 client. Every call raises EtcdUnavailable (or one of its kinds)
    when etcd does not serve it, LeaseLost when a write names a lease etcd forgot.

    `endpoint` is one member or several ("a:2379,b:2379"). `timeout_s` bounds each RPC: it
    must be shorter than the lease TTLs the caller keeps alive, or one stuck call could let a
    lease lapse. A call tries each member at most once.
    """

    def __init__(self, endpoint: str, *, auth: EtcdAuth | None = None, timeout_s: float = 3.0):
        """`auth`: TLS and user (default: plaintext, no user; loopback only unless
        `auth.insecure`)."""
        self.endpoint = endpoint
        self.members = parse_endpoints(endpoint)
        self.auth = auth or EtcdAuth()
        self.auth.check(endpoint, [parse_endpoint(m)[0] for m in self.members])
        self.timeout_s = timeout_s
        self._index = 0
        self._generation = 0  # bumped at each switch of member
        self._served = False  # the current member answered at least once
        self._refusing_writes = False
        self._largest: dict[bytes, int] = {}  # a range's end -> its largest key and value
        self._switch_lock = asyncio.Lock()
        self._closing: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                         name="etcd-client")
        self._thread.start()
        self._client: _Client = self._new_client(self.members[0])
        self._closed = False

    @property
    def member(self) -> str:
        """The member this process talks to now."""
        return self.members[self._index]

    def _new_client(self, member: str) -> _Client:
        host, port = parse_endpoint(member)
        return _Client(host=host, port=port, auth=self.auth, timeout=self.timeout_s,
                       options=dict(_CHANNEL_OPTIONS))

    async def _switch(self, generation: int, why: Exception) -> None:
        """Drop the channel to a failed member and open one to the next. Callers that saw
        the same failure switch once: the first one wins, the others find a newer generation."""
        async with self._switch_lock:
            if generation != self._generation or len(self.members) == 1:
                return
            old, index = self._client, (self._index + 1) % len(self.members)
            if self._served:
                log.warning("etcd member %s failed (%s); switching to %s", self.member, why,
                            self.members[index])
            self._client, self._index, self._served = (self._new_client(self.members[index]),
                                                       index, False)
            self._generation += 1
        # Closed in the background: closing a channel to a dead member can take a while, and
        # its calls in flight fail over by themselves.
        task = asyncio.get_running_loop().create_task(self._close_quietly(old))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_quietly(client: aetcd.Client) -> None:
        try:
            await asyncio.wait_for(client.close(), 5.0)
        except (Exception, asyncio.CancelledError):
            pass  # the channel of a dead member may not close cleanly; it is dropped anyway

    def _run(self, call: Callable[[aetcd.Client], Awaitable]):
        """Run `call(client)` on the loop; on a member's failure, again on the next member
        (each at most once). When every member failed and one of them said it has no leader,
        that is what is raised: the cluster has lost its quorum."""
        errors: list[Exception] = []
        overtaken = 0  # calls cut short by another thread's switch: not this member's fault
        reauthenticated = False
        while True:
            generation, client, member = self._generation, self._client, self.member
            token = client.token
            fut = asyncio.run_coroutine_threadsafe(call(client), self._loop)
            try:
                result = fut.result(self.timeout_s + 2.0)
                self._served = True
                return result
            except (Exception, asyncio.CancelledError) as e:
                fut.cancel()
                error = classify(e, member, self.auth)
                if error is None:
                    raise
                cause = e
            if generation != self._generation and overtaken < len(self.members):
                overtaken += 1
                continue
            if isinstance(error, EtcdTokenExpired) and not reauthenticated:
                reauthenticated = True
                self._reauthenticate(client, member, token)
                continue
            errors.append(error)
            if isinstance(error, EtcdUnavailable) and error.member_fault and len(self.members) > 1:
                asyncio.run_coroutine_threadsafe(self._switch(generation, error),
                                                 self._loop).result(self.timeout_s + 2.0)
                if len(errors) < len(self.members):
                    continue
                error = next((e for e in errors if isinstance(e, EtcdNoLeader)), error)
            if error is cause:
                raise error
            raise error from cause

    def _reauthenticate(self, client: _Client, member: str, stale: str | None) -> None:
        fut = asyncio.run_coroutine_threadsafe(client.renew_token(stale), self._loop)
        try:
            fut.result(self.timeout_s + 2.0)
        except (Exception, asyncio.CancelledError) as e:
            fut.cancel()
            error = classify(e, member, self.auth)
            if error is None:
                raise
            raise error from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._close_quietly(self._client),
                                             self._loop).result(self.timeout_s + 3.0)
        except Exception:  # closing a client whose server is gone is not worth a traceback
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: str) -> KV | None:
        got = self._run(lambda c: c.get(key.encode()))
        return None if got is None else _kv(got)

    def snapshot(self, prefixes: Sequence[str]) -> Snapshot:
        """All keys under `prefixes` at a single revision: one read-only transaction, whose
        ranges continue in pages at that revision when they hold more keys than a page or do
        not fit one answer."""
        return reread_if_compacted(lambda: self._snapshot(prefixes), times=3)

    def _snapshot(self, prefixes: Sequence[str]) -> Snapshot:
        ranges = [(p.encode(), prefix_range_end(p.encode())) for p in prefixes]
        limits = [self._fit(end, len(ranges)) for _, end in ranges]
        ops = [rpc.RequestOp(request_range=rpc.RangeRequest(key=k, range_end=end, limit=n))
               for (k, end), n in zip(ranges, limits)]
        kvs: dict[str, KV] = {}
        largest: dict[bytes, int] = {}  # a range's end -> its largest key and value read
        resp = None
        if min(limits) >= SAFE_PAGE_KEYS:  # else one answer might not hold a page of each
            try:
                resp = self._run(lambda c: self._unary(c, "kvstub", "Txn",
                                                       rpc.TxnRequest(success=ops)))
            except EtcdTooLarge:
                pass  # read range by range, page by page
        if resp is None:
            revision, rest = 0, ranges
        else:
            revision, rest = resp.header.revision, []
            for (_, end), r in zip(ranges, resp.responses):
                got = r.response_range
                for raw in got.kvs:
                    kvs[raw.key.decode()] = _kv(raw)
                    largest[end] = max(largest.get(end, 0), len(raw.key) + len(raw.value))
                if got.more:
                    rest.append((got.kvs[-1].key + b"\0", end))
        for start, end in rest:
            revision = self._pages(start, end, revision, kvs, largest)
        for _, end in ranges:
            self._largest[end] = largest.get(end, 0)
        return Snapshot(revision=revision, kvs=kvs)

    def _fit(self, end: bytes, ranges: int = 1) -> int:
        """Keys per page of the range ending at `end` when `ranges` ranges share one answer:
        as many as half an answer holds at the largest key and value the range held when last
        read (at most PAGE_KEYS; PAGE_KEYS when never read)."""
        largest = self._largest.get(end) or 0
        return PAGE_KEYS if not largest else min(PAGE_KEYS,
                                                 MAX_RECEIVE // 2 // (largest * ranges))

    def _pages(self, start: bytes, end: bytes, revision: int, into: dict[str, KV],
               largest: dict[bytes, int]) -> int:
        """Read [start, end) at `revision` (0: the current one) page by page, into `into` and
        its largest key and value into `largest`; returns the revision read at."""
        for revision, kvs in self._paged(start, end, revision):
            for raw in kvs:
                into[raw.key.decode()] = _kv(raw)
            largest[end] = max(largest.get(end, 0), _largest(kvs))
        return revision

    def _paged(self, start: bytes, end: bytes, revision: int, *, min_create_revision: int = 0):
        """The pages of [start, end) at `revision` (0: the current one), each as the revision
        read at and its raw key-values; only the keys created at `min_create_revision` or
        later when given (etcd filters them). A page that does not fit an answer is asked for
        again with fewer keys; past it, pages grow back as fast as the values let them."""
        keys = max(SAFE_PAGE_KEYS, self._fit(end))
        while True:
            req = rpc.RangeRequest(key=start, range_end=end, revision=revision, limit=keys,
                                   min_create_revision=min_create_revision)
            try:
                resp = self._run(lambda c: self._unary(c, "kvstub", "Range", req))
            except EtcdTooLarge:
                if keys == 1:
                    raise EtcdTooLarge(f"a value under {start[:80]!r} does not fit an answer "
                                       f"of {MAX_RECEIVE} bytes: etcd's --max-request-bytes "
                                       "is above it") from None
                keys = SAFE_PAGE_KEYS if keys > SAFE_PAGE_KEYS else 1
                continue
            revision = revision or resp.header.revision
            yield revision, resp.kvs
            if not resp.more or not resp.kvs:
                return
            start = resp.kvs[-1].key + b"\0"
            # past a large value, pages grow back as fast as the values let them
            keys = max(SAFE_PAGE_KEYS, min(PAGE_KEYS, 2 * keys,
                                           MAX_RECEIVE // 2 // max(_largest(resp.kvs), 1)))

    def created_after(self, prefix: str, *, after_revision: int, start: str | None = None
                      ) -> tuple[list[KV], int]:
        """The keys under `prefix` (from `start`, when given) created after `after_revision`,
        in key order, paged at one revision; and that revision. etcd filters them: what is
        sent is only what is new (a follower of an append-only prefix, as the events are)."""
        got, revision = [], 0
        for revision, kvs in self._paged((start or prefix).encode(),
                                         prefix_range_end(prefix.encode()), 0,
                                         min_create_revision=after_revision + 1):
            got += [_kv(raw) for raw in kvs]
        return got, revision

    async def _unary(self, client: aetcd.Client, stub: str, method: str, request):
        """A call aetcd does not wrap (or wraps without paging): its stubs exist once
        connected."""
        await client.connect()
        call = getattr(getattr(client, stub), method)
        return await call(request, timeout=self.timeout_s, metadata=client.metadata)

    def get_prefix(self, prefix: str) -> Snapshot:
        return self.snapshot([prefix])

    def revision(self, key: str) -> int:
        """etcd's current revision, read without reading any key's value. `key`: one the
        caller may read (etcd checks the right even for a count), e.g. its key prefix."""
        req = rpc.RangeRequest(key=key.encode(), count_only=True)
        return self._run(lambda c: self._unary(c, "kvstub", "Range", req)).header.revision

    # -- writes --------------------------------------------------------------------------------
    @property
    def refusing_writes(self) -> bool:
        """The last write etcd was asked for was refused for lack of space (NOSPACE): reads
        still work then, so only a write that goes through tells that the alarm is over."""
        return self._refusing_writes

    def _write(self, call: Callable[[aetcd.Client], Awaitable]):
        try:
            result = self._run(call)
        except EtcdNoSpace:
            self._refusing_writes = True
            raise
        self._refusing_writes = False
        return result

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Unconditional put; returns the new revision. Leaders use `txn` instead."""
        return self._write(lambda c: c.put(key.encode(), value, lease=lease)).header.revision

    def delete(self, key: str, *, prefix: bool = False) -> None:
        if prefix:
            self._run(lambda c: c.delete_prefix(key.encode()))
        else:
            self._run(lambda c: c.delete(key.encode()))

    def txn(self, compare: Iterable, success: Iterable = (), failure: Iterable = ()) -> bool:
        compare, success, failure = list(compare), list(success), list(failure)
        writes = any(isinstance(op, aetcd.transactions.Put) for op in success + failure)
        ok, _ = (self._write if writes else self._run)(
            lambda c: c.transaction(compare, success, failure))
        return bool(ok)

    def txn_revision(self, compare: Iterable, success: Iterable) -> int | None:
        """`txn` for a writer that waits to see its write come back through a watch: None
        when a compare failed (nothing written), else the revision its changes are at (0 when
        they changed nothing: deletes of keys that were not there)."""
        compare, success = list(compare), list(success)
        writes = any(isinstance(op, aetcd.transactions.Put) for op in success)
        ok, responses = (self._write if writes else self._run)(
            lambda c: c.transaction(compare, success, []))
        if not ok:
            return None
        changed = [0]
        for r in responses:
            kind = r.WhichOneof("response")
            if kind == "response_put" or (kind == "response_delete_range"
                                          and r.response_delete_range.deleted):
                changed.append(getattr(r, kind).header.revision)
        return max(changed)

    # -- leases --------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        return self._write(lambda c: c.lease(ttl_s)).id

    def refresh(self, lease_id: int) -> int:
        """Keep a lease alive; returns its remaining TTL, 0 or less when it has expired."""
        reply = self._run(lambda c: c.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease; one that is already gone is fine."""
        try:
            self._run(lambda c: c.revoke_lease(lease_id))
        except LeaseLost:
            pass

    # -- maintenance ---------------------------------------------------------------------------
    def alarms(self) -> list[Alarm]:
        """The cluster's raised alarms (NOSPACE, CORRUPT), any member's."""
        req = rpc.AlarmRequest(action=rpc.AlarmRequest.GET, memberID=0, alarm=rpc.NONE)
        resp = self._run(lambda c: self._unary(c, "maintenancestub", "Alarm", req))
        return [Alarm(member_id=a.memberID, kind=rpc.AlarmType.Name(a.alarm))
                for a in resp.alarms]

    def disarm(self, alarm: Alarm) -> None:
        """Operators' tool: clear an alarm once its cause is gone (after a defragmentation)."""
        req = rpc.AlarmRequest(action=rpc.AlarmRequest.DEACTIVATE, memberID=alarm.member_id,
                               alarm=rpc.AlarmType.Value(alarm.kind))
        self._run(lambda c: self._unary(c, "maintenancestub", "Alarm", req))

    def leader_url(self) -> str:
        """A client URL of the member that leads the cluster now: what the gRPC API does not
        carry (the leader's wall clock, lazarus.agent.clockskew) is asked of it over HTTP."""
        status = self._run(lambda c: self._unary(c, "maintenancestub", "Status",
                                                 rpc.StatusRequest()))
        members = self._run(lambda c: self._unary(c, "clusterstub", "MemberList",
                                                  rpc.MemberListRequest()))
        for m in members.members:
            if m.ID == status.leader and m.clientURLs:
                return str(m.clientURLs[0])
        raise EtcdNoLeader(f"{self.member} names no leader with a client URL")

    def compact(self, revision: int) -> None:
        """Drop the history before `revision` (keys' current values stay). Compacting to a
        revision already compacted is fine."""
        req = rpc.CompactionRequest(revision=revision)
        try:
            self._run(lambda c: self._unary(c, "kvstub", "Compact", req))
        except EtcdCompacted:
            pass

    def defragment(self) -> None:
        """Operators' tool: give the space compaction freed back to the file system, on the
        member this client talks to. The member serves nothing while it runs."""
        req = rpc.DefragmentRequest()
        self._run(lambda c: self._unary(c, "maintenancestub", "Defragment", req))

    def db_size(self) -> int:
        """Bytes of the current member's database file (what --quota-backend-bytes limits)."""
        resp = self._run(lambda c: self._unary(c, "maintenancestub", "Status", rpc.StatusRequest()))
        return int(resp.dbSize)

    def auth_call(self, method: str, request):
        """A call of etcd's Auth API (users, roles, enabling authentication), by its method
        name: lazarus.core.etcd_rbac sets our users and roles up with it."""
        return self._run(lambda c: self._unary(c, "auth_stub", method, request))

    # -- watches -------------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, *, start_revision: int,
                     on_events: Callable[[list[Event]], None],
                     on_resync: Callable[[], int] | None = None) -> "Watch":
        """Call `on_events` for every change under `prefix` from `start_revision` on.

        A broken stream is resumed from the last delivered revision + 1 (on another member if
        this one failed), so nothing is missed or repeated. When that revision has been
        compacted away, `on_resync` is called: it must re-list and return the revision to
        watch from (the snapshot revision + 1); without it the watch goes on from the current
        revision + 1 and the changes in between are lost.
        Callbacks run on the client's loop thread: keep them tiny (set an event, queue items).
        """
        w = Watch(self, prefix, start_revision, on_events, on_resync)
        w.task = asyncio.run_coroutine_threadsafe(w.run(), self._loop)
        return w


class Watch:
    def __init__(self, etcd: Etcd, prefix: str, start_revision: int,
                 on_events: Callable[[list[Event]], None],
                 on_resync: Callable[[], int] | None):
        self._etcd = etcd
        self.prefix = prefix
        self.next_revision = start_revision
        self._on_events = on_events
        self._on_resync = on_resync or (lambda: etcd.revision(prefix) + 1)
        self._cancelled = False
        self.task = None

    async def run(self) -> None:
        backoff = Backoff(initial_s=0.1, max_s=2.0)
        refused = False  # the last try was refused: not said again
        while not self._cancelled:
            etcd = self._etcd
            generation, client, member = etcd._generation, etcd._client, etcd.member
            try:
                stream = await client.watch_prefix(self.prefix.encode(),
                                                   start_revision=self.next_revision)
                backoff.reset()
                async for ev in stream:
                    kv = _kv(ev.kv)
                    self.next_revision = kv.mod_revision + 1
                    self._on_events([Event(kind=str(ev.kind), kv=kv)])
                    if self._cancelled:
                        await stream.cancel()
                        return
                # The stream ended without an error: its channel was closed (a switch of
                # member). Watch again on the current one.
            except asyncio.CancelledError:
                return
            except StreamRenewed:
                continue  # the client has a new token; so will the next stream
            except Exception as e:
                if self._cancelled:
                    return
                error = classify(e, member, etcd.auth) or e
                if isinstance(error, EtcdTokenExpired):
                    # etcd refused the token of the watch stream (it restarted since the
                    # stream was opened, or the token idled out)
                    try:
                        await client.renew_token(client.watch_token)
                        continue
                    except Exception as again:
                        log.debug("watch on %s: authenticating again failed: %s",
                                  self.prefix, classify(again, member, etcd.auth) or again)
                if isinstance(error, (EtcdCompacted, EtcdTooLarge)):
                    # Too large: the history to catch up on does not fit one answer; the
                    # current state, re-listed in pages, does.
                    await self._resync(backoff, error)
                    continue
                # A refusal (no right to the prefix) is a mistake of the setup, not an outage:
                # said once, and tried again in case an operator mends the role.
                first_refusal = isinstance(error, EtcdRefused) and not refused
                refused = isinstance(error, EtcdRefused)
                log.log(logging.WARNING if first_refusal else logging.DEBUG,
                        "watch on %s broke (%s); resuming from revision %d", self.prefix, error,
                        self.next_revision)
                if isinstance(error, EtcdUnavailable) and error.member_fault:
                    await etcd._switch(generation, error)
            await asyncio.sleep(backoff.next())

    async def _resync(self, backoff: "Backoff", why: Exception) -> None:
        """The caller re-lists (blocking etcd calls, so in a thread, not on this loop) until
        etcd answers; the watch goes on from the revision it returns."""
        log.info("watch on %s cannot resume at revision %d (%s); re-listing", self.prefix,
                 self.next_revision, why)
        loop = asyncio.get_running_loop()
        while not self._cancelled:
            try:
                self.next_revision = await loop.run_in_executor(None, self._on_resync)
                return
            except EtcdUnavailable as e:
                log.debug("re-list of %s failed (%s); retrying", self.prefix, e)
                await asyncio.sleep(backoff.next())

    def cancel(self) -> None:
        self._cancelled = True
        if self.task is not None:
            self.task.cancel()


class Backoff:
    """Exponential backoff with full jitter; one instance per retried thing."""

    def __init__(self, *, initial_s: float = 0.05, max_s: float = 2.0):
        self.initial_s, self.max_s = initial_s, max_s
        self._next = initial_s

    def next(self) -> float:
        delay = random.uniform(self._next / 2, self._next)
        self._next = min(self._next * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next = self.initial_s


def reread_if_compacted(read: Callable[[], T], *, times: int) -> T:
    """`read()` (one read in pages at one revision), done again up to `times` times when etcd
    compacted that revision away between two pages: the next read is at a newer one. The last
    EtcdCompacted is raised."""
    done = 0
    while True:
        try:
            return read()
        except EtcdCompacted:
            done += 1
            if done > times:
                raise


def retry(fn: Callable[[], object], *, deadline_s: float,
          backoff: Backoff | None = None) -> object:
    """Call `fn` until it stops raising EtcdUnavailable or the deadline passes.

    Only for idempotent calls (reads; writes guarded by a compare). The last error is raised
    once the deadline is spent.
    """
    backoff = backoff or Backoff()
    end = time.monotonic() + deadline_s
    while True:
        try:
            return fn()
        except EtcdUnavailable:
            if time.monotonic() + backoff.initial_s >= end:
                raise
            time.sleep(min(backoff.next(), max(0.0, end - time.monotonic())))


class Session:
    """A lease kept alive in the background: the liveness of one process as etcd sees it.

    Keys put with `session.lease` vanish `ttl_s` after this process stops refreshing (dies,
    hangs, or is partitioned). The keep-alive runs every ttl/3. When etcd says the lease is
    gone, `on_lost` is called once and the session is dead: the owner must stop acting on what
    it held (a leader stops leading) and start a new session.
    While etcd is merely unreachable, leaderless or out of space the session keeps trying:
    etcd restarts lease timers when it elects a leader again (docs/constraints.md, "etcd and
    its clients"), so a short outage does not cost the lease, and keep-alives work under the
    NOSPACE alarm.
    """

    def __init__(self, etcd: Etcd, *, ttl_s: int, on_lost: Callable[[], None] | None = None,
                 resume: int | None = None):
        """`resume`: a lease a predecessor of this process held (an agent restarted within
        its TTL): kept if etcd still has it, so the keys under it never vanish; else a new
        lease is granted."""
        assert ttl_s >= 2, "a lease shorter than 2 s cannot be refreshed reliably"
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.resumed = False
        if resume:
            try:
                self.resumed = etcd.refresh(resume) > 0
            except LeaseLost:
                pass
        self.lease = resume if self.resumed else etcd.grant(ttl_s)
        self._on_lost = on_lost
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, daemon=True,
                                        name=f"lease-{self.lease:x}")
        self._thread.start()

    def _keepalive(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                alive = self.etcd.refresh(self.lease) > 0
            except EtcdUnavailable:
                continue
            except LeaseLost:
                alive = False
            if not alive:
                self.mark_lost()
                return

    def mark_lost(self) -> None:
        """The lease is gone (expired, or a write was refused for it): tell the owner once."""
        if self.lost.is_set():
            return
        self.lost.set()
        self._stop.set()
        log.warning("etcd lease %x expired", self.lease)
        if self._on_lost is not None:
            self._on_lost()

    def close(self, *, revoke: bool = True) -> None:
        if self._stop.is_set() and not revoke:
            return
        self._stop.set()
        if revoke and not self.lost.is_set():
            try:
                self.etcd.revoke(self.lease)
            except EtcdUnavailable:
                pass
