"""Our one etcd v3 client per process: a synchronous face on `aetcd`.

aetcd is asyncio-only and opens a gRPC channel per client; two gRPC etcd clients in one
process also clash in protobuf's descriptor pool (FACTS.md). So each process owns exactly one
`Etcd`, which runs aetcd on a private event loop thread, and the daemon, the agent and the
torchrun rendezvous backend call it synchronously.

What lives here and nowhere else:
- retries with backoff (`retry`), for idempotent reads and for writes guarded by a compare;
- consistent snapshots: several prefixes read in one transaction, so at one revision;
- fenced writes: `txn` with compares, used for every write a leader or a round owner makes;
- sessions: a lease with a background keep-alive (aetcd has none) and a "lost" callback;
- watches that resume from the last seen revision + 1, and re-list after a compaction or a
  broken stream (the callback is told to resync).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# We fork worker processes while gRPC threads run; gRPC's fork handlers only add noise then.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aetcd  # noqa: E402
import aetcd.exceptions as aexc
from aetcd import rpc  # noqa: E402
from aetcd.utils import prefix_range_end

from lazarus.core.errors import UserError  # noqa: E402

log = logging.getLogger(__name__)


class EtcdUnavailable(ConnectionError):
    """etcd did not answer (down, partitioned, or restarting). Retry later."""


class LeaseLost(RuntimeError):
    """etcd no longer knows the lease a write named: its owner's session is over."""


# gRPC backs off reconnects exponentially up to 2 minutes by default; after a long etcd outage
# the client would then sit out many seconds after etcd is back, longer than a lease TTL, and
# every lease would lapse. Reconnect attempts stay at most a second apart instead.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}


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


def _kv(raw) -> KV:
    return KV(key=raw.key.decode(), value=raw.value, create_revision=raw.create_revision,
              mod_revision=raw.mod_revision, version=raw.version, lease=raw.lease)


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


def delete_op(key: str, *, prefix: bool = False):
    k = key.encode()
    return aetcd.transactions.Delete(k, range_end=prefix_range_end(k) if prefix else None)


_TRANSIENT = (aexc.ConnectionFailedError, aexc.ConnectionTimeoutError, aexc.InternalError,
              EtcdUnavailable, asyncio.TimeoutError, TimeoutError)


class Etcd:
    """A synchronous etcd v3 client. Every call raises EtcdUnavailable when etcd is away.

    `timeout_s` bounds each RPC: it must be shorter than the lease TTLs the caller keeps alive,
    or one stuck call could let a lease lapse.
    """

    def __init__(self, endpoint: str, *, timeout_s: float = 3.0):
        self.endpoint = endpoint
        host, port = parse_endpoint(endpoint)
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                         name="etcd-client")
        self._thread.start()
        self._client: aetcd.Client = self._run(self._make(host, port), direct=True)
        self._closed = False

    async def _make(self, host: str, port: int) -> aetcd.Client:
        return aetcd.Client(host=host, port=port, timeout=self.timeout_s,
                            options=dict(_CHANNEL_OPTIONS))

    def _run(self, coro, *, direct: bool = False):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(self.timeout_s + 2.0)
        except _TRANSIENT as e:
            fut.cancel()
            raise EtcdUnavailable(f"etcd at {self.endpoint} unavailable: {e}") from e
        except aexc.ClientError as e:
            if "lease not found" in str(e):
                raise LeaseLost(str(e)) from e
            if "UNAVAILABLE" in str(e) or "Connection" in type(e).__name__:
                raise EtcdUnavailable(f"etcd at {self.endpoint} unavailable: {e}") from e
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._client.close())
        except Exception:  # closing a client whose server is gone is not worth a traceback
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: str) -> KV | None:
        got = self._run(self._client.get(key.encode()))
        return None if got is None else _kv(got)

    def snapshot(self, prefixes: Sequence[str]) -> Snapshot:
        """All keys under `prefixes` at a single revision (one read-only transaction)."""
        ops = [rpc.RequestOp(request_range=rpc.RangeRequest(
            key=p.encode(), range_end=prefix_range_end(p.encode()))) for p in prefixes]

        async def txn():
            await self._client.connect()
            return await self._client.kvstub.Txn(rpc.TxnRequest(success=ops),
                                                 timeout=self.timeout_s)
        try:
            resp = self._run(txn())
        except aetcd.rpc.AioRpcError as e:
            raise EtcdUnavailable(f"etcd at {self.endpoint} unavailable: {e.code().name}") from e
        kvs: dict[str, KV] = {}
        for r in resp.responses:
            for raw in r.response_range.kvs:
                kv = _kv(raw)
                kvs[kv.key] = kv
        return Snapshot(revision=resp.header.revision, kvs=kvs)

    def get_prefix(self, prefix: str) -> Snapshot:
        return self.snapshot([prefix])

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Unconditional put; returns the new revision. Leaders use `txn` instead."""
        return self._run(self._client.put(key.encode(), value, lease=lease)).header.revision

    def delete(self, key: str, *, prefix: bool = False) -> None:
        if prefix:
            self._run(self._client.delete_prefix(key.encode()))
        else:
            self._run(self._client.delete(key.encode()))

    def txn(self, compare: Iterable, success: Iterable = (), failure: Iterable = ()) -> bool:
        ok, _ = self._run(self._client.transaction(list(compare), list(success), list(failure)))
        return bool(ok)

    # -- leases --------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        return self._run(self._client.lease(ttl_s)).id

    def refresh(self, lease_id: int) -> int:
        """Keep a lease alive; returns its remaining TTL, 0 or less when it has expired."""
        reply = self._run(self._client.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    def revoke(self, lease_id: int) -> None:
        """Revoke a lease; one that is already gone is fine."""
        try:
            self._run(self._client.revoke_lease(lease_id))
        except LeaseLost:
            pass

    # -- watches -------------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, *, start_revision: int,
                     on_events: Callable[[list[Event]], None],
                     on_resync: Callable[[], int] | None = None) -> "Watch":
        """Call `on_events` for every change under `prefix` from `start_revision` on.

        A broken stream is resumed from the last delivered revision + 1, so nothing is missed
        or repeated. When that revision has been compacted away, `on_resync` is called: it must
        re-list and return the revision to watch from (the snapshot revision + 1).
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
        self._on_resync = on_resync
        self._cancelled = False
        self.task = None

    async def run(self) -> None:
        client = self._etcd._client
        backoff = Backoff(initial_s=0.1, max_s=2.0)
        while not self._cancelled:
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
            except aexc.RevisionCompactedError:
                if self._on_resync is None:
                    raise
                # The caller re-lists in a thread (it does blocking etcd calls on this loop).
                self.next_revision = await asyncio.get_running_loop().run_in_executor(
                    None, self._on_resync)
            except asyncio.CancelledError:
                return
            except Exception as e:  # a broken stream: etcd restarting or unreachable
                if self._cancelled:
                    return
                log.debug("watch on %s broke (%s); resuming from revision %d",
                          self.prefix, e, self.next_revision)
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
    While etcd is merely unreachable the session keeps trying: etcd restarts lease timers when
    it comes back (FACTS.md), so a short outage does not cost the lease.
    """

    def __init__(self, etcd: Etcd, *, ttl_s: int, on_lost: Callable[[], None] | None = None):
        assert ttl_s >= 2, "a lease shorter than 2 s cannot be refreshed reliably"
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.lease = etcd.grant(ttl_s)
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
