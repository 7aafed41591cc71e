"""The replica port under attack by someone without the key (docs/security.md, "Tier-0
snapshots"): a flood of raw connections -- headers announcing the largest payload the port
takes, connections that say nothing, bytes dripped slowly -- costs the agent neither memory
nor threads, and the job's own agents go on sending and fetching copies afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time

import psutil
import pytest

from lazarus.agent import replica
from lazarus.agent.tier0 import Tier0Store
from lazarus.core import snapshotfile

KEY = b"k" * 32
# The largest copy the port takes: what a header announces. Small enough that the flood
# against an agent that allocated before authenticating stays within a test machine.
LIMIT = 64 << 20
CONNECTIONS, BATCH = 1000, 25


def shard(step: int = 5, rank: int = 1) -> bytes:
    return snapshotfile.pack({"job": "j", "round": 2, "rank": rank, "world_size": 2,
                              "step": step}, b"tensors" * 100)


@pytest.fixture
def server(tmp_path):
    store = Tier0Store(tmp_path / "t0", limit_bytes=LIMIT)

    def accept(job, rank, step, data, round_):
        store.add_replica(job, rank, step, data)

    server = replica.ReplicaServer("127.0.0.1", key=KEY, accept=accept, find=store.path,
                                   max_bytes=LIMIT)
    yield server
    server.close()


def announcing(size: int) -> bytes:
    """What a forger sends first: a plausible header and a payload length, an arbitrary tag."""
    head = json.dumps({"op": "put", "from": "x", "job": "j", "rank": 1, "step": 5, "round": 2,
                       "time": time.time()}).encode()
    return len(head).to_bytes(4, "big") + head + (size + 68).to_bytes(8, "big") + b"\0" * 68


def _connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=2)
    except OSError:
        return None  # the backlog is full: refused before the agent saw it, which is fine


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # closed by the agent at once: what a bounded port does


def _settled(before: int, slack: int, timeout: float = 15.0) -> int:
    me = psutil.Process()
    deadline = time.monotonic() + timeout
    while me.num_threads() > before + slack and time.monotonic() < deadline:
        time.sleep(0.1)
    return me.num_threads()


def test_a_flood_without_the_key_costs_no_memory_nor_threads(server):
    me = psutil.Process()
    replica.push("127.0.0.1", server.port, KEY, node="n0", job="j", rank=1, step=5,
                 data=shard(), round_=2)  # warm: the first transfer's own allocations
    rss0, threads0 = me.memory_info().rss, _settled(me.num_threads(), 0, timeout=2)
    peak_rss, peak_threads = rss0, threads0
    for start in range(0, CONNECTIONS, BATCH):
        socks = [s for s in (_connect(server.port) for _ in range(BATCH)) if s is not None]
        for i, sock in enumerate(socks):
            kind = (start + i) % 3
            if kind == 0:
                _send(sock, announcing(LIMIT))       # a header announcing the largest payload
            elif kind == 1:
                _send(sock, announcing(LIMIT)[:1])   # slow: one byte now, the rest never
            # kind 2 says nothing at all
        time.sleep(0.2)  # the agent reads what was sent while the connections stay open
        peak_rss = max(peak_rss, me.memory_info().rss)
        peak_threads = max(peak_threads, me.num_threads())
        for sock in socks:
            sock.close()
    assert peak_rss - rss0 < 50 << 20, f"grew by {(peak_rss - rss0) >> 20} MiB"
    assert peak_threads - threads0 <= 10, f"{peak_threads - threads0} more threads"
    _settled(threads0, 0)
    # The job's own agents are served as before.
    replica.push("127.0.0.1", server.port, KEY, node="n0", job="j", rank=1, step=6,
                 data=shard(step=6), round_=2)
    assert replica.fetch("127.0.0.1", server.port, KEY, node="s0", job="j", rank=1, step=6,
                         max_bytes=LIMIT) == shard(step=6)


def test_a_connection_dripping_its_header_is_closed_at_the_header_deadline(server, monkeypatch):
    monkeypatch.setattr(replica, "HEADER_S", 1.0)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    started, closed = time.monotonic(), None
    with sock:
        for byte in announcing(LIMIT):
            try:
                sock.sendall(bytes([byte]))
                time.sleep(0.2)  # well within any per-read timeout
                sock.setblocking(False)
                if sock.recv(1) == b"":
                    closed = time.monotonic() - started
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed = time.monotonic() - started
                break
            finally:
                sock.setblocking(True)
            if time.monotonic() - started > 10:
                break
    assert closed is not None and closed < 3, "a header dripped byte by byte held the port"


def test_connections_beyond_the_cap_are_closed_at_once_and_honest_ones_then_served(server):
    quiet = [s for s in (_connect(server.port) for _ in range(replica.MAX_CONNECTIONS))
             if s is not None]
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    with extra:
        extra.settimeout(2)
        try:
            got = extra.recv(1)
        except ConnectionResetError:
            got = b""
    assert got == b"", "a connection over the cap was kept"
    for sock in quiet:
        sock.close()
    deadline = time.monotonic() + 5
    while True:  # the closed ones free their slots as the agent sees them go
        try:
            replica.push("127.0.0.1", server.port, KEY, node="n0", job="j", rank=1, step=5,
                         data=shard(), round_=2)
            break
        except replica.ReplicaError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_concurrent_honest_transfers_all_succeed(server):
    errors = []

    def one(step):
        try:
            replica.push("127.0.0.1", server.port, KEY, node="n0", job="j", rank=1, step=step,
                         data=shard(step=step), round_=2)
        except replica.ReplicaError as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
