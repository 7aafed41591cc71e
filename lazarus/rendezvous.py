"""`torchrun --rdzv-backend lazarus-etcd`: torch elastic's dynamic rendezvous kept in etcd v3.

torch's own `etcd` and `etcd-v2` backends speak etcd's v2 API, which etcd 3.4 disables and
3.6 removed. This backend keeps the rendezvous state in one etcd v3 key, written by
compare-and-set on that key's mod_revision, and gives the agents a c10d store on etcd too, so
the only thing the nodes of a job share is an etcd endpoint:

    torchrun --rdzv-backend lazarus-etcd --rdzv-endpoint HOST:PORT --rdzv-id JOB \\
             --nnodes 1:4 --nproc-per-node 8 train.py

Keys (under `key_prefix`, default /lazarus/v1/torchrun/):

    <run_id>/state            the pickled rendezvous state torch's DynamicRendezvousHandler
                              reads and writes; the fencing token is its mod_revision
    <run_id>/store/<key>      the agents' c10d store (rank 0's address per round, the exit
                              barrier); torch namespaces it by rendezvous round

Every key is bound to a lease of the agent that wrote it last, refreshed while the agent
writes heartbeats: a job's keys vanish `state_ttl` seconds after its last agent stops. Until
then a finished job's rendezvous stays closed, so give each job its own --rdzv-id.

Values are sealed (lazarus.core.sealed): torch unpickles the state, and unpickling runs code,
so whoever could write one etcd key would run code in every agent of the job. Every value
carries an HMAC-SHA256 tag under a key the job's agents share ($LAZARUS_RDZV_KEY, or the file
--rdzv-conf key_file=PATH names), checked before anything is unpickled. A state whose tag does
not match is logged and taken for an empty one (as if the key were missing), which the agents
then overwrite; a store key whose tag does not match is taken for an absent one.
`--rdzv-conf insecure=1` seals under an empty key anyone can forge: only where nobody
untrusted can write to the etcd.

Restarts: torch's agent shares one TCP store server with its workers across restarts, and on
CPU restarted workers then read the dead workers' keys (docs/constraints.md, "torch and torch
elastic"). This backend turns that sharing off (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless
you set it) so every attempt's rank 0 hosts a fresh store.

--rdzv-conf options, besides torch's join_timeout, last_call_timeout, close_timeout,
heartbeat_timeout, keep_alive_interval and keep_alive_max_attempt: see RendezvousEtcdConfig.
A secure etcd (docs/operations.md, "Securing etcd") takes its TLS files and user there too,
or from the environment (LAZARUS_ETCD_CA, ..., LAZARUS_ETCD_PASSWORD):

    --rdzv-endpoint https://etcd:2379 --rdzv-conf etcd_ca=/etc/lazarus/ca.pem,\
        etcd_cert=/etc/lazarus/client.pem,etcd_key=/etc/lazarus/client-key.pem,\
        etcd_user=trainer,etcd_password_file=/etc/lazarus/trainer.password
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import EtcdAuth

BACKEND_NAME = "lazarus-etcd"
KEY_ENV = "LAZARUS_RDZV_KEY"

log = logging.getLogger("lazarus.rendezvous")


# torch imports this module while it imports torch.distributed.elastic.rendezvous (to read the
# `torchrun.handlers` entry points), so these two come before the torch imports below: when
# this module is imported first, torch finds them in the half-loaded module.
def create_rdzv_handler() -> Callable:
    """The `torchrun.handlers` entry point: torch calls it with no arguments and registers the
    handler factory it returns under the entry point's name."""
    return make_handler


def make_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """RendezvousParameters -> a DynamicRendezvousHandler whose state and store live in etcd."""
    cfg = RendezvousEtcdConfig.from_params(params)
    space = EtcdSpace(process_etcd(params.endpoint, cfg), cfg)
    backend = EtcdRendezvousBackend(space, params.run_id)
    if cfg.insecure:
        log.warning("rendezvous %r: --rdzv-conf insecure=1: the state in etcd is not "
                    "authenticated; whoever can write to etcd at %s can run code in this "
                    "agent", params.run_id, params.endpoint)
    # Reach etcd now: a wrong endpoint fails here in etcd_timeout, not after join_timeout.
    current = backend.get_state()
    try:
        closed = current is not None and pickle.loads(current[0]).closed
    except Exception as e:  # a garbled pickle raises whatever the bytes lead it to
        raise RendezvousStateError(
            f"the rendezvous state of {params.run_id!r} in etcd at {params.endpoint} is "
            f"unreadable ({type(e).__name__}: {e}); delete {backend.key} or give this job "
            "another --rdzv-id") from None
    # torch would only say "RendezvousClosedError"; torchrun's default run id is "none", so
    # a second job started soon after the first would hit this without a hint.
    if closed:
        raise RendezvousClosedError(
            f"the rendezvous {params.run_id!r} in etcd at {params.endpoint} is closed: a job with "
            f"this --rdzv-id finished less than {cfg.state_ttl_s} s ago (its keys expire then); "
            f"give this job its own --rdzv-id")
    store = EtcdStore(space, backend.store_prefix, timeout=timedelta(seconds=cfg.read_timeout_s))
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return create_handler(store, backend, params)


import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import (  # noqa: E402
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousBackend,
    _RendezvousState,
    create_handler,
)

from lazarus.core.sealed import Forged, load_key, seal, unseal  # noqa: E402

if TYPE_CHECKING:
    from lazarus.core.etcd import KV, Etcd

# lazarus.core.etcd (aetcd + grpc, 0.3 s) is imported inside functions: torch imports this module
# in every process that loads torch.distributed.elastic, every trainer worker included.

_process_client: Etcd | None = None
_process_lock = threading.Lock()


def process_etcd(endpoint: str, cfg: RendezvousEtcdConfig) -> Etcd:
    """This process's one etcd client (two gRPC etcd clients in one process clash)."""
    # lazily: torch imports this module in every worker; aetcd and grpc load on first use
    from lazarus.core.etcd import Etcd

    global _process_client
    with _process_lock:
        if _process_client is None:
            _process_client = Etcd(endpoint, auth=cfg.auth,
                                   timeout_s=min(3.0, cfg.etcd_timeout_s))
        elif _process_client.endpoint != endpoint:
            raise UserError(f"this process already uses etcd at {_process_client.endpoint}; "
                            f"it cannot also rendezvous through {endpoint}")
        return _process_client


@dataclass(kw_only=True, slots=True)
class RendezvousEtcdConfig:
    """The backend's --rdzv-conf options (`--rdzv-conf key_prefix=/x/,etcd_timeout=5`).

    key_prefix    where the job's keys live; several users can share one etcd.
    etcd_timeout  seconds an etcd call keeps retrying while etcd does not answer before the
                  agent fails; longer than an etcd restart, or a restart fails the job.
    state_ttl     seconds the keys outlive the last agent writing them; at least three
                  keep_alive_interval, or a running job's state could expire between
                  heartbeats.
    read_timeout  seconds an agent waits for a peer's store key (rank 0's address, the exit
                  barrier) before failing the rendezvous.
    etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file
                  TLS and user for etcd, as the flags of the same names of `lazarus agent`
                  (lazarus.core.etcd_auth); each falls back to its environment variable.
    key_file      file holding the key every agent of the job seals its values with (at
                  least 16 characters); default: $LAZARUS_RDZV_KEY. One of the two is needed.
    insecure      1: as `lazarus agent --insecure` (plaintext etcd off loopback), and the key
                  may be left out: values are then sealed under an empty key anyone can forge.
    """

    key_prefix: str = "/lazarus/v1/torchrun/"
    etcd_timeout_s: float = 10.0
    state_ttl_s: int = 60
    read_timeout_s: float = 60.0
    auth: EtcdAuth = field(default_factory=EtcdAuth)
    seal_key: bytes = b""
    insecure: bool = False

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RendezvousEtcdConfig:
        def number(key: str, default: float) -> float:
            raw = params.get(key)
            try:
                value = default if raw is None else float(raw)
            except ValueError:
                raise ValueError(f"--rdzv-conf {key}={raw!r} is not a number of seconds") from None
            if value <= 0:
                raise ValueError(f"--rdzv-conf {key}={raw!r} must be positive")
            return value

        defaults = cls()
        prefix = params.get("key_prefix", defaults.key_prefix)
        if not prefix.startswith("/"):
            raise ValueError(f"--rdzv-conf key_prefix={prefix!r} must start with '/'")
        insecure = _flag(params.get("insecure"), "insecure")
        try:
            auth = EtcdAuth.load(ca=params.get("etcd_ca"), cert=params.get("etcd_cert"),
                                 key=params.get("etcd_key"), user=params.get("etcd_user"),
                                 password_file=params.get("etcd_password_file"),
                                 insecure=insecure)
        except UserError as e:
            raise ValueError(f"--rdzv-conf: {e}") from None
        key = load_key(file=params.get("key_file"), env=KEY_ENV, what="--rdzv-conf key_file")
        if key is None and not insecure:
            raise ValueError(
                f"no rendezvous key: set ${KEY_ENV} (or --rdzv-conf key_file=PATH) to the same "
                f"secret on every agent of the job, e.g. from `openssl rand -hex 32`; it proves "
                f"that the state in etcd, which torch unpickles, was written by one of them "
                f"(--rdzv-conf insecure=1 goes without, for an etcd nobody untrusted can write)")
        cfg = cls(key_prefix=prefix if prefix.endswith("/") else prefix + "/",
                  etcd_timeout_s=number("etcd_timeout", defaults.etcd_timeout_s),
                  state_ttl_s=int(number("state_ttl", defaults.state_ttl_s)),
                  read_timeout_s=number("read_timeout", defaults.read_timeout_s), auth=auth,
                  seal_key=b"" if key is None else key, insecure=key is None)
        keep_alive_s = params.get_as_int("keep_alive_interval", 5)
        if cfg.state_ttl_s < 3 * keep_alive_s:
            raise ValueError(f"--rdzv-conf state_ttl={cfg.state_ttl_s} must be at least three "
                             f"keep_alive_interval ({keep_alive_s} s)")
        return cfg


def _flag(raw: str | None, name: str) -> bool:
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"--rdzv-conf {name}={raw!r} is not 1 or 0")


class EtcdSpace:
    """What the backend and its store share: the client, retries, the agent's lease, and the
    seal on every value."""

    def __init__(self, etcd: Etcd, cfg: RendezvousEtcdConfig):
        self.etcd = etcd
        self.cfg = cfg
        self._lease: int | None = None
        self._refreshed_at = 0.0
        # Heartbeats write from a timer thread while the agent's main thread uses the store.
        self._lock = threading.Lock()
        self._refused: dict[str, int] = {}  # key -> revision of the value last refused

    def sealed(self, key: str, payload: bytes) -> bytes:
        return seal(self.cfg.seal_key, key.encode(), payload)

    def opened(self, kv: KV) -> bytes | None:
        """The payload of a value read back; None (logged once per value) when its seal does
        not prove one of the job's agents wrote it there: it is never parsed."""
        try:
            return unseal(self.cfg.seal_key, kv.key.encode(), kv.value)
        except Forged as e:
            with self._lock:
                first = self._refused.get(kv.key) != kv.mod_revision
                self._refused[kv.key] = kv.mod_revision
            if first:
                log.error("refusing %s in etcd (revision %d): %s; taking it for absent. Every "
                          "agent of the job needs the same key ($%s or --rdzv-conf key_file); "
                          "if they have it, someone else wrote this value", kv.key,
                          kv.mod_revision, e, KEY_ENV)
            return None

    def call(self, fn: Callable[[], object], doing: str):
        """Run `fn` (a read, or a write guarded by a compare), retrying while etcd is away."""
        # lazily: torch imports this module in every worker; aetcd and grpc load on first use
        from lazarus.core.etcd import EtcdUnavailable, retry

        try:
            return retry(fn, deadline_s=self.cfg.etcd_timeout_s)
        except EtcdUnavailable as e:
            raise RendezvousConnectionError(
                f"etcd at {self.etcd.endpoint} did not answer for {self.cfg.etcd_timeout_s:g} s "
                f"while {doing} (is an etcd v3 server running there?): {e}") from e

    def lease(self) -> int:
        """The lease to bind writes to; refreshed here, since every agent writes a heartbeat
        every keep_alive_interval, which is at most a third of the TTL."""
        with self._lock:
            now = time.monotonic()
            if self._lease is None or now - self._refreshed_at > self.cfg.state_ttl_s / 2:
                if self._lease is None or self.etcd.refresh(self._lease) <= 0:
                    self._lease = self.etcd.grant(self.cfg.state_ttl_s)
                self._refreshed_at = now
            return self._lease

    def get(self, key: str) -> KV | None:
        return self.call(lambda: self.etcd.get(key), f"reading {key}")


class EtcdRendezvousBackend(RendezvousBackend):
    """The rendezvous state in one etcd key; the token is the key's mod_revision."""

    def __init__(self, space: EtcdSpace, run_id: str):
        self._space = space
        base = f"{space.cfg.key_prefix}{run_id}/"
        self.key = base + "state"
        self.store_prefix = base + "store/"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, int] | None:
        kv = self._space.get(self.key)
        return None if kv is None else (self._state_of(kv), kv.mod_revision)

    def _state_of(self, kv: KV) -> bytes:
        """The state to unpickle: the sealed one, or, for a value the job's agents did not
        write, an empty state of our own pickling, whose token (the forged value's revision)
        lets the next write replace it."""
        state = self._space.opened(kv)
        return pickle.dumps(_RendezvousState()) if state is None else state

    def set_state(self, state: bytes, token: int | None = None) -> tuple[bytes, int, bool] | None:
        # lazily: torch imports this module in every worker; aetcd and grpc load on first use
        from lazarus.core.etcd import delete_op, key_missing, mod_revision_is, put_op

        etcd, key = self._space.etcd, self.key

        sealed = self._space.sealed(key, state)

        def attempt() -> bool:
            put = put_op(key, sealed, lease=self._space.lease())
            if token is None:
                # A new incarnation of this run id: drop store keys an older one left behind.
                return etcd.txn([key_missing(key)],
                                [put, delete_op(self.store_prefix, prefix=True)])
            return etcd.txn([mod_revision_is(key, token)], [put])

        won = self._space.call(attempt, f"writing {key}")
        # A txn's reply carries no revision, so read the token back. Whatever state is there now
        # was written on top of ours if we won. A lost compare whose value is ours is our own
        # write whose reply was lost on a retry.
        kv = self._space.get(key)
        if kv is None:
            return None
        return self._state_of(kv), kv.mod_revision, won or kv.value == sealed


class EtcdStore(dist.Store):
    """The c10d store the agents share, on etcd (keys under `prefix`).

    `get` and `wait` poll until the key appears or the store's timeout passes (then
    DistStoreError, as TCPStore raises). The agents use it a few times per rendezvous, so
    polling costs nothing worth a watch. Values are sealed like the state; one whose seal
    does not match is taken for an absent key.
    """

    def __init__(self, space: EtcdSpace, prefix: str, *, timeout: timedelta):
        super().__init__()
        self._space = space
        self._prefix = prefix
        self.set_timeout(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        path = self._prefix + key
        sealed = self._space.sealed(path, data)
        self._space.call(lambda: self._space.etcd.put(path, sealed, lease=self._space.lease()),
                         f"writing {path}")

    def get(self, key: str) -> bytes:
        return self._wait_for([key], self.timeout)[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, self.timeout if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        return all(self._value(self._prefix + k) is not None for k in keys)

    def _value(self, path: str) -> bytes | None:
        kv = self._space.get(path)
        return None if kv is None else self._space.opened(kv)

    def add(self, key: str, amount: int) -> int:
        # lazily: torch imports this module in every worker; aetcd and grpc load on first use
        from lazarus.core.etcd import key_missing, mod_revision_is, put_op

        etcd, path = self._space.etcd, self._prefix + key
        while True:
            kv = self._space.get(path)
            current = None if kv is None else self._space.opened(kv)
            try:
                value = amount + (0 if current is None else int(current))
            except ValueError:
                raise dist.DistStoreError(f"{path} holds {current[:40]!r}, not a counter: "
                                          "add() cannot add to it") from None
            guard = key_missing(path) if kv is None else mod_revision_is(path, kv.mod_revision)
            put = put_op(path, self._space.sealed(path, str(value).encode()),
                         lease=self._space.lease())
            if self._space.call(lambda: etcd.txn([guard], [put]), f"adding to {path}"):
                return value

    def _wait_for(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        # lazily: torch imports this module in every worker; aetcd and grpc load on first use
        from lazarus.core.etcd import Backoff

        deadline = time.monotonic() + timeout.total_seconds()
        backoff = Backoff(initial_s=0.01, max_s=0.2)
        found: dict[str, bytes] = {}
        while True:
            for k in keys:
                if k not in found and (value := self._value(self._prefix + k)) is not None:
                    found[k] = value
            if len(found) == len(keys):
                return [found[k] for k in keys]
            if time.monotonic() >= deadline:
                missing = [k for k in keys if k not in found]
                raise dist.DistStoreError(
                    f"store keys {missing} under {self._prefix} did not appear within "
                    f"{timeout.total_seconds():g} s")
            time.sleep(backoff.next())
