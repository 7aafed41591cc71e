"""Tier-0 snapshots between agents: each agent sends its ranks' snapshots to the next member
of the round (a ring), and hands a copy it holds to the agent that restores that rank.

One request per TCP connection, one answer:

    request  = header length (4 bytes) | header (JSON) | sealed(payload)
    header   = {"op": "put" | "get", "job", "rank", "step", "from" (node), "time",
                "to" (the receiving node), "port" (its replica port), "nonce"}
    answer   = the same framing: {"ok", "error", "re" (the request's nonce)} and, to a get,
               the snapshot file

Every message is sealed with HMAC-SHA256 under the key the job's agents share
(lazarus.core.sealed), over its header, its payload's length and the sha256 digest its payload
(a snapshot file, or nothing: a get's request, a refusal) ends with -- not over the payload
itself: the payload must then end with that digest and pass its own checksum against it,
here, before anything reads it (lazarus.core.snapshotfile). The HMAC of a 2 GB shard would
cost one of the agent's cores about 1.5 s on each side, for nothing the checksum does not
already prove. So neither side takes a shard, nor a request for one, from anyone without the
key; a header more than MAX_SKEW_S off this clock is refused, which bounds replays, and within
that window a request is taken once: it names its destination (node and port: a request
captured on its way to one agent is refused by any other, and by the same node's next agent)
and a nonce the server remembers until the request's date is stale (at most MAX_NONCES; past
that, requests are refused until some expire). An answer repeats its request's nonce. A
received shard must also be a snapshot of the rank and step its header names.

Payloads travel in the clear unless the operator asks (`--replica-encrypt`): then every
payload an agent sends, and every answer it asks for, is encrypted with AES-256-GCM under a
key of its own, derived from the replica key and a random salt (HKDF), in chunks of
ENC_CHUNK bytes, each sealed with the message's tag, its index and whether it is the last as
associated data (no chunk can be moved, dropped or spliced from another message), under the
message's random 96-bit nonce XORed with the chunk's index (`MessageCipher`). The sealed
header says so ("enc", "salt", "iv"); an encrypting agent refuses a
payload in the clear, and one that does not encrypt still takes and answers encrypted
transfers, so a job can turn it on node by node. An encrypted message's sealed digest is
zeros (the plaintext's sha256 would be a fingerprint of the shard): the AEAD tags vouch for
the payload instead, and the snapshot's own checksum still holds after decryption.

    message = header length (4) | header (JSON) | payload length (8) | digest (32)
              | MAGIC + tag (36) | payload
    tag     = HMAC-SHA256(key, ... | CONTEXT | header length | header | payload length | digest)
    digest  = the payload's last 32 bytes (zeros for no payload)

Everything before the payload is sealed, and checked before a byte of the payload is read or
a byte of memory is set aside for it: someone without the key costs the agent a few hundred
bytes and one of MAX_CONNECTIONS slots for at most HEADER_S (docs/security.md, "Tier-0
snapshots"). Connections beyond the slots are closed at once.
"""

from __future__ import annotations

import heapq
import json
import logging
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lazarus.core import sealed, snapshotfile
from lazarus.core.snapshotfile import SnapshotError

log = logging.getLogger(__name__)

MAX_SKEW_S = 120.0
MAX_HEADER = 64 << 10
# A client's wait for the answer: the peer writes a put into its store (or reads a get's file)
# before it answers.
TIMEOUT_S = 30.0
# All of a request's sealed part, on the server: a few hundred bytes from a peer on the same
# network arrive in milliseconds; a slower sender is a slot held by someone.
HEADER_S = 5.0
# A payload's own deadline: this floor plus its size at BODY_RATE (64 Mbit/s, a small fraction
# of any link between training nodes). Sealed first, so only a key holder gets that long.
BODY_FLOOR_S, BODY_RATE = 30.0, 8 << 20
# Transfers at once. A node receives from one ring neighbour and is fetched from by the few
# nodes that replace lost ones; each slot is a thread.
MAX_CONNECTIONS = 8
# Nonces remembered at once: a node takes a few requests per rank and snapshot; a key holder
# flooding it with fresh requests is refused past this (its memory stays a few MB).
MAX_NONCES = 1 << 16


class ReplicaError(OSError):
    """A transfer that did not happen: unreachable peer, refused, forged or garbled."""


class BadPayload(ReplicaError):
    """A sealed message whose snapshot fails its own checksum: damaged on the way, or at the
    sender. The sender is told (a forger is not)."""


# Versions the sealing: an agent of another framing is refused, not misread.
CONTEXT = b"lazarus-replica-4\0"
_SEAL = len(sealed.MAGIC) + sealed.TAG_BYTES
_DIGEST = 32  # sha256, at the end of every snapshot file
_NO_DIGEST = bytes(_DIGEST)
# Encryption (see the module's doc): the scheme's name in a header, its chunk size, AES-GCM's
# tag; per message a salt and a nonce (MessageCipher).
ENC = "aes-256-gcm-8m-hkdf"
ENC_CHUNK = 8 << 20
_GCM_TAG = 16
_SALT_BYTES, _IV_BYTES = 16, 12


class MessageCipher:
    """One message's AES-256-GCM, the same object on both ends: its key is HKDF(the replica
    key, a random 128-bit salt), never the HMAC key itself, and chunk i's nonce the message's
    random 96-bit nonce XORed with i.

    GCM is broken by one (key, nonce) used twice. Chunks of a message differ by their index;
    two messages share a key only if they draw the same salt, and then a nonce only if they
    also draw the same 96-bit nonce: at 4,096 ranks sending a copy every 30 s (4.3e9 messages
    a year) a repeated salt has a chance of about 3e-20 in that year; one key with 64-bit
    random IVs, as before, had about 40%."""

    def __init__(self, key: bytes, salt: bytes, iv: bytes):
        if len(salt) != _SALT_BYTES or len(iv) != _IV_BYTES:
            raise ReplicaError("an encrypted payload without its salt and nonce")
        self.salt, self.iv = salt, iv
        self._aead = AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=salt,
                                 info=b"lazarus-replica-encryption-2").derive(key))

    @classmethod
    def new(cls, key: bytes) -> MessageCipher:
        return cls(key, secrets.token_bytes(_SALT_BYTES), secrets.token_bytes(_IV_BYTES))

    @classmethod
    def of(cls, key: bytes, header: dict) -> MessageCipher:
        """The cipher a received (sealed) header names; ReplicaError when it names none."""
        try:
            return cls(key, bytes.fromhex(header["salt"]), bytes.fromhex(header["iv"]))
        except (KeyError, TypeError, ValueError):
            raise ReplicaError("an encrypted payload without its salt and nonce") from None

    def fields(self) -> dict:
        return {"salt": self.salt.hex(), "iv": self.iv.hex()}

    def _nonce(self, i: int) -> bytes:
        return (int.from_bytes(self.iv, "big") ^ i).to_bytes(_IV_BYTES, "big")

    def encrypt(self, i: int, part: bytes | memoryview, aad: bytes) -> bytes:
        return self._aead.encrypt(self._nonce(i), part, aad)

    def decrypt(self, i: int, data: bytes | memoryview, aad: bytes) -> bytes:
        """Chunk i in the clear; cryptography's InvalidTag when it, or the salt, nonce or
        `aad` it was sealed with, is not what was sent."""
        return self._aead.decrypt(self._nonce(i), data, aad)


def _chunk_aad(seal: bytes, i: int, last: bool) -> bytes:
    return seal + i.to_bytes(4, "big") + (b"\1" if last else b"\0")


def _wire_size(plain: int) -> int:
    return plain + _GCM_TAG * -(-plain // ENC_CHUNK)


def _plain_size(wire: int) -> int | None:
    """The plaintext size of `wire` encrypted bytes, or None when no plaintext makes it."""
    chunks = -(-wire // (ENC_CHUNK + _GCM_TAG))
    plain = wire - _GCM_TAG * chunks
    return plain if plain >= 0 and _wire_size(plain) == wire else None


def _context(head: bytes, length: int, digest: bytes) -> bytes:
    return CONTEXT + len(head).to_bytes(4, "big") + head + length.to_bytes(8, "big") + digest


def _digest(payload: bytes | bytearray | memoryview) -> bytes:
    return bytes(memoryview(payload)[-_DIGEST:]) if len(payload) else _NO_DIGEST


def _send(sock: socket.socket, key: bytes, header: dict,
          payload: bytes | bytearray | memoryview = b"", *, encrypt: bool = False) -> None:
    encrypt = encrypt and len(payload) > 0
    cipher = MessageCipher.new(key) if encrypt else None
    if cipher is not None:
        header = {**header, "enc": ENC, **cipher.fields()}
    head = json.dumps(header, sort_keys=True).encode()
    digest = _NO_DIGEST if encrypt else _digest(payload)
    length = _wire_size(len(payload)) if encrypt else len(payload)
    seal = sealed.tag(key, _context(head, length, digest))
    sock.sendall(len(head).to_bytes(4, "big") + head + length.to_bytes(8, "big")
                 + digest + seal)
    if cipher is None:
        if len(payload):
            sock.sendall(payload)
        return
    view = memoryview(payload)
    chunks = -(-len(view) // ENC_CHUNK)
    for i in range(chunks):
        part = view[i * ENC_CHUNK:(i + 1) * ENC_CHUNK]
        sock.sendall(cipher.encrypt(i, part, _chunk_aad(seal, i, i == chunks - 1)))


def _recv_encrypted(sock: socket.socket, key: bytes, header: dict, seal: bytes,
                    payload: bytearray, wire: int, deadline: float) -> None:
    """Receive `wire` encrypted bytes and decrypt them into `payload`, chunk by chunk."""
    cipher, buf = MessageCipher.of(key, header), bytearray(min(wire, ENC_CHUNK + _GCM_TAG))
    chunks, at = -(-wire // (ENC_CHUNK + _GCM_TAG)), 0
    for i in range(chunks):
        n = min(ENC_CHUNK + _GCM_TAG, wire - i * (ENC_CHUNK + _GCM_TAG))
        _recv_into(sock, memoryview(buf)[:n], deadline, "the payload")
        try:
            plain = cipher.decrypt(i, memoryview(buf)[:n], _chunk_aad(seal, i, i == chunks - 1))
        except InvalidTag:
            raise BadPayload(f"chunk {i} of the encrypted snapshot fails its tag: damaged or "
                             "altered on the way") from None
        payload[at:at + len(plain)] = plain
        at += len(plain)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float, what: str) -> None:
    """Fill `view` from `sock` by `deadline` (time.monotonic()), or ReplicaError: a deadline
    for the whole, not per read, or a sender dripping a byte at a time holds on for ever."""
    got, n = 0, len(view)
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReplicaError(f"{what} too slow: {got} of {n} bytes in time")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], min(n - got, 1 << 20))
        except TimeoutError:
            raise ReplicaError(f"{what} too slow: {got} of {n} bytes in time") from None
        if not k:
            raise ReplicaError(f"connection closed after {got} of {n} bytes of {what}")
        got += k


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline, what)
    return bytes(buf)


def _recv(sock: socket.socket, key: bytes, *, max_payload: int, header_s: float,
          admit: Callable[[dict], None] = lambda header: None, encrypted_only: bool = False
          ) -> tuple[dict, bytearray, dict | None]:
    """(header, payload, the payload's snapshot header or None when it is empty): sealed
    under `key`, fresh, admitted by `admit` (ReplicaError: refused), and a payload that passes
    its checksum, or ReplicaError. The seal is checked before the payload is read;
    `header_s`: the time the sealed part may take. `encrypted_only`: a payload in the clear
    is refused unread."""
    deadline = time.monotonic() + header_s
    size = int.from_bytes(_recv_exact(sock, 4, deadline, "the header"), "big")
    if size > MAX_HEADER:
        raise ReplicaError(f"a header of {size} bytes: not a replica message")
    head = _recv_exact(sock, size, deadline, "the header")
    sealed_part = _recv_exact(sock, 8 + _DIGEST + _SEAL, deadline, "the header")
    length = int.from_bytes(sealed_part[:8], "big")
    digest, seal = sealed_part[8:8 + _DIGEST], sealed_part[8 + _DIGEST:]
    try:
        sealed.check(key, _context(head, length, digest), seal)
    except sealed.Forged as e:
        raise ReplicaError(f"refused an unauthenticated message: {e}") from None
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise ReplicaError(f"a header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ReplicaError("a header that is not a JSON object")
    enc = header.get("enc")
    if enc is not None and enc != ENC:
        raise ReplicaError(f"a payload encrypted as {str(enc)[:40]!r}, not {ENC}")
    if enc is None and length and encrypted_only:
        raise ReplicaError("a payload in the clear: this agent takes encrypted copies only "
                           "(--replica-encrypt)")
    plain = length if enc is None else _plain_size(length)
    if plain is None or (enc is not None and (plain == 0 or digest != _NO_DIGEST)):
        raise ReplicaError(f"an encrypted payload of {length} bytes: no chunking makes that")
    # From here on the sender holds the key: its announced size is trusted up to the limit.
    if plain > max_payload:
        raise ReplicaError(f"a payload of {plain} bytes, not 0..{max_payload}")
    _fresh(header)  # a replay is refused before its payload costs memory
    admit(header)
    payload = bytearray(plain)
    deadline = time.monotonic() + BODY_FLOOR_S + length / BODY_RATE
    if enc is None:
        _recv_into(sock, memoryview(payload), deadline, "the payload")
    else:
        _recv_encrypted(sock, key, header, seal, payload, length, deadline)
    snap = None
    if payload:
        try:  # the seal covers the digest: the payload is the sender's only if this holds
            if enc is None and _digest(payload) != digest:
                raise SnapshotError("the snapshot received does not end with the digest "
                                    "it was sealed with: damaged on the way")
            snap = snapshotfile.verify(payload, "the snapshot received")
        except SnapshotError as e:
            raise BadPayload(str(e)) from None
    elif digest != _NO_DIGEST:
        raise ReplicaError("an empty payload sealed with a digest")
    return header, payload, snap


def _fresh(header: dict) -> None:
    at = header.get("time")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or abs(time.time() - at) > MAX_SKEW_S:
        raise ReplicaError(f"a message dated {at!r}, more than {MAX_SKEW_S:.0f} s off this clock")


def _address(header: dict) -> tuple[str, int, int]:
    job, rank, step = header.get("job"), header.get("rank"), header.get("step")
    if not isinstance(job, str) or isinstance(rank, bool) or not isinstance(rank, int) \
            or isinstance(step, bool) or not isinstance(step, int):
        raise ReplicaError(f"a request without job, rank and step: {str(header)[:120]}")
    return job, rank, step


class _Nonces:
    """The nonces of the requests taken, each until its request's date is MAX_SKEW_S old
    (after that the clock check refuses the request anyway)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._expiry: list[tuple[float, str]] = []  # a heap

    def take(self, nonce: object, at: float) -> None:
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64:
            raise ReplicaError("a request without a nonce")
        now = time.time()
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                raise ReplicaError("a request taken before (replayed)")
            if len(self._seen) >= MAX_NONCES:
                raise ReplicaError(f"{MAX_NONCES} requests within {MAX_SKEW_S:.0f} s")
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (at + MAX_SKEW_S, nonce))


class _Server(socketserver.ThreadingTCPServer):
    """A thread per connection, MAX_CONNECTIONS at most: one more is closed at once, unread
    (its sender sees the connection end and tries again later)."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 64  # a burst of connections is answered (closed), not left to retry

    def __init__(self, *args, **kwargs):
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            log.debug("tier-0 connection from %s closed: %d transfers at once already",
                      client_address[0], MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started: nothing else will
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class ReplicaServer:
    """Serves puts into and gets from this agent's store. `accept(job, rank, step, data,
    round)` stores a verified copy (ReplicaError: refused); `find(job, rank, step)` is the path of one, or None.
    `max_bytes`: the largest snapshot taken (the store's limit). `node`: the name requests
    must be addressed to (this agent's node). At most MAX_CONNECTIONS transfers at once;
    each must deliver its sealed header within HEADER_S. `encrypt`: take encrypted copies
    only, and send every copy encrypted (else only to those who ask)."""

    def __init__(self, host: str, *, key: bytes,
                 accept: Callable[[str, int, int, bytes, int], None],
                 find: Callable[[str, int, int], Path | None], max_bytes: int,
                 node: str = "", encrypt: bool = False):
        self.key, self.accept, self.find, self.max_bytes = key, accept, find, max_bytes
        self.node, self.encrypt = node, encrypt
        self._nonces = _Nonces()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    server._serve(self.request)
                except (OSError, ValueError) as e:
                    log.warning("tier-0 transfer from %s refused: %s", self.client_address[0], e)

        self._tcp = _Server((host, 0), Handler)
        self.port = self._tcp.server_address[1]
        threading.Thread(target=self._tcp.serve_forever, daemon=True,
                         name="tier0-server").start()

    def _admit(self, header: dict) -> None:
        if header.get("to") != self.node or header.get("port") != self.port:
            raise ReplicaError(f"a request for {str(header.get('to'))[:64]!r} port "
                               f"{str(header.get('port'))[:8]}, not for this node")
        self._nonces.take(header.get("nonce"), header["time"])

    def _serve(self, sock: socket.socket) -> None:
        try:
            header, payload, got = _recv(sock, self.key, max_payload=self.max_bytes,
                                         header_s=HEADER_S, admit=self._admit,
                                         encrypted_only=self.encrypt)
        except BadPayload as e:
            sock.settimeout(TIMEOUT_S)
            _send(sock, self.key, {"ok": False, "error": str(e), "time": time.time()})
            raise
        sock.settimeout(TIMEOUT_S)  # for the answer: _recv left its deadline's remainder
        re_ = header["nonce"]
        job, rank, step = _address(header)
        if header.get("op") == "put":
            if got is None:
                raise ReplicaError("a put without a snapshot")
            if (got["job"], got["rank"], got["step"]) != (job, rank, step):
                raise ReplicaError(f"a snapshot of rank {got['rank']} step {got['step']} sent "
                                   f"as rank {rank} step {step}")
            round_ = header.get("round")
            if isinstance(round_, bool) or not isinstance(round_, int):
                raise ReplicaError("a copy without its round")
            try:
                self.accept(job, rank, step, payload, round_)
            except ReplicaError as e:
                _send(sock, self.key, {"ok": False, "error": str(e), "time": time.time(),
                                       "re": re_})
                raise
            _send(sock, self.key, {"ok": True, "time": time.time(), "re": re_})
        elif header.get("op") == "get":
            path = self.find(job, rank, step)
            if path is None:
                _send(sock, self.key, {"ok": False, "time": time.time(), "re": re_,
                                       "error": f"no copy of rank {rank} step {step} here"})
                return
            _send(sock, self.key, {"ok": True, "time": time.time(), "re": re_, "job": job,
                                   "rank": rank, "step": step}, path.read_bytes(),
                  encrypt=self.encrypt or header.get("want_enc") is True)
        else:
            raise ReplicaError(f"unknown op {header.get('op')!r}")

    def close(self) -> None:
        self._tcp.shutdown()
        self._tcp.server_close()


def _request(host: str, port: int, key: bytes, header: dict, payload: bytes, *,
             max_bytes: int, encrypt: bool = False) -> tuple[dict, bytes]:
    nonce = secrets.token_hex(16)
    if encrypt:
        header = {**header, "want_enc": True}  # the answer's payload too
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
            _send(sock, key, {**header, "port": port, "nonce": nonce, "time": time.time()},
                  payload, encrypt=encrypt)
            answer, data, _ = _recv(sock, key, max_payload=max_bytes, header_s=TIMEOUT_S,
                                    encrypted_only=encrypt)
    except OSError as e:
        raise ReplicaError(f"{host}:{port}: {e}") from None
    if answer.get("ok") is not True:
        raise ReplicaError(f"{host}:{port} refused: {str(answer.get('error'))[:300]}")
    if answer.get("re") != nonce:  # an answer to another request, played back
        raise ReplicaError(f"{host}:{port} answered another request")
    return answer, data


def push(host: str, port: int, key: bytes, *, node: str, job: str, rank: int, step: int,
         data: bytes | memoryview, round_: int, to: str = "", encrypt: bool = False) -> None:
    """Send a snapshot file, taken in round `round_`, to the agent of node `to` at host:port
    (ReplicaError if it did not take it); `encrypt`: on the wire as the module's doc says."""
    _request(host, port, key, {"op": "put", "from": node, "to": to, "job": job, "rank": rank,
                               "step": step, "round": round_}, data, max_bytes=0,
             encrypt=encrypt)


def fetch(host: str, port: int, key: bytes, *, node: str, job: str, rank: int, step: int,
          max_bytes: int, to: str = "", encrypt: bool = False) -> bytearray:
    """A snapshot file from the agent of node `to` at host:port, checked to be the one asked
    for; `encrypt`: asked for, and taken only, encrypted."""
    answer, data = _request(host, port, key, {"op": "get", "from": node, "to": to, "job": job,
                                              "rank": rank, "step": step}, b"",
                            max_bytes=max_bytes, encrypt=encrypt)
    if not data:
        raise ReplicaError(f"{host}:{port} answered without the snapshot")
    got = snapshotfile.read_header(data, f"rank {rank} step {step} from {host}:{port}")
    if (got["job"], got["rank"], got["step"]) != (job, rank, step):
        raise ReplicaError(f"{host}:{port} sent rank {got['rank']} step {got['step']} for "
                           f"rank {rank} step {step}")
    return data
