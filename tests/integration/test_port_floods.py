"""Every port a node's agent or a daemon listens on, under a flood of connections from someone
with no credentials (docs/security.md): 1,000 connections each, opened in batches and held
-- garbage, a plausible start of the port's protocol that never goes on, silence -- leave the
serving process's memory and threads where they were, and a legitimate client is served
afterwards.

The ports, each served as the product starts it: the agent's TCP store (torch's,
unauthenticated; a round's own store is the same kind) in a process of its own, the agent's
worker channel (a unix socket), the daemon's gRPC API and its Prometheus endpoint
(`--metrics-port`) in this one. The replica port has its own test (test_replica_flood.py);
the gloo/NCCL ports are the ranks', not the agent's. One fails today, in code that is not
Lazarus's own (torch's store): its xfail says how. (The metrics port failed too, with
prometheus_client's own server: lazarus.daemon.metricsport replaced it.)"""

from __future__ import annotations

import datetime
import errno
import json
import os
import random
import resource
import select
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import grpc
import psutil
import pytest

from lazarus.agent.channel import Channel
from lazarus.daemon import api, telemetry
from lazarus.proto.lazarus.v1 import lazarus_pb2 as pb
from lazarus.proto.lazarus.v1 import lazarus_pb2_grpc as pb_grpc

CONNECTIONS, BATCH = 1000, 25
MAX_RSS_GROWTH, MAX_THREAD_GROWTH = 50 << 20, 10
TOKEN = "flood-token-0123456789"
# A legitimate client's wait after the flood.
SERVED_S = 10.0


@dataclass
class Flooded:
    rss: int        # the server process's growth at the worst moment, in bytes
    threads: int    # ... in threads
    reached: int    # connections the server's kernel completed (the rest: backlog full)


def flood(addr: str | tuple[str, int], lure: bytes, proc: psutil.Process) -> Flooded:
    """Open CONNECTIONS connections to `addr`, BATCH at a time, each held open until the last
    is made: a third send random bytes, a third `lure` (a start of the protocol that
    announces more and never sends it), a third nothing. Connections are opened without
    waiting on each: a server whose backlog is full (its SYNs dropped) does not slow the
    flood down."""
    family = socket.AF_UNIX if isinstance(addr, str) else socket.AF_INET
    rng = random.Random(7)
    rss0, threads0 = proc.memory_info().rss, proc.num_threads()
    peak_rss, peak_threads = rss0, threads0
    held: list[socket.socket] = []

    def connected(socks: list[socket.socket], wait_s: float) -> list[socket.socket]:
        poll = select.poll()  # not select(): past fd 1024
        for sock in socks:
            poll.register(sock, select.POLLOUT)
        ready = {fd for fd, _ in poll.poll(int(wait_s * 1000))}
        return [s for s in socks if s.fileno() in ready
                and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)]

    try:
        for start in range(0, CONNECTIONS, BATCH):
            batch = []
            for _ in range(BATCH):
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                held.append(sock)
                if sock.connect_ex(addr) in (0, errno.EINPROGRESS, errno.EAGAIN):
                    batch.append(sock)
            for i, sock in enumerate(connected(batch, 0.2)):
                kind = (start + i) % 3
                data = (rng.randbytes(rng.randrange(1, 4096)) if kind == 0 else
                        lure if kind == 1 else b"")
                try:
                    sock.send(data)
                except OSError:
                    pass  # hung up on at once
            time.sleep(0.05)
            peak_rss = max(peak_rss, proc.memory_info().rss)
            peak_threads = max(peak_threads, proc.num_threads())
        reached = len(connected(held, 0.5))
        peak_rss = max(peak_rss, proc.memory_info().rss)
        peak_threads = max(peak_threads, proc.num_threads())
    finally:
        for sock in held:
            sock.close()
    return Flooded(peak_rss - rss0, peak_threads - threads0, reached)


@pytest.fixture(autouse=True)
def enough_files():
    """The flood's connections, and the in-process servers' ends of them, at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 3 * CONNECTIONS if hard == resource.RLIM_INFINITY else min(hard, 3 * CONNECTIONS)
    if want < 3 * CONNECTIONS:
        pytest.skip(f"{hard} files per process at most: the flood needs {3 * CONNECTIONS}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def assert_flat(f: Flooded) -> None:
    assert f.reached > CONNECTIONS // 10, f"only {f.reached} connections reached the server"
    assert f.rss < MAX_RSS_GROWTH, f"RSS grew by {f.rss >> 20} MiB"
    assert f.threads < MAX_THREAD_GROWTH, f"{f.threads} more threads"


# The agent's store, as lazarus.agent.service hosts it (a round's store is the same kind), in
# a process of its own, as in an agent.
_STORE = """
import sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


@pytest.mark.xfail(strict=False, reason=(
    "torch's TCPStore looks up the name of every connection's peer (a reverse DNS query, "
    "glibc's resolver, up to 5 s a try) on its one event-loop thread before it reads the "
    "next: each stranger's connection holds every client of the store back by one lookup "
    "(77 ms here: 1,000 connections stall the store about 80 s). Passes where lookups "
    "fail at once (no nameserver)"))
def test_the_agents_tcp_store(tmp_path):
    import torch.distributed as dist

    log = tmp_path / "store.log"
    with open(log, "wb") as err:
        child = subprocess.Popen([sys.executable, "-c", _STORE], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err)
    try:
        port = int(child.stdout.readline())
        proc = psutil.Process(child.pid)
        timeout = datetime.timedelta(seconds=SERVED_S)
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout).set("warm", "1")
        # validate (torch's magic number), then a set of a 1 GB value that never comes
        lure = (bytes([0]) + struct.pack("<I", 0x3C85F7CE) + bytes([1])
                + struct.pack("<Q", 4) + b"lure" + struct.pack("<Q", 1 << 30))
        flooded = flood(("127.0.0.1", port), lure, proc)
        assert_flat(flooded)
        # torch's client opens with these two (validate, ping): bounded here, where a
        # torch client would wait on
        with socket.create_connection(("127.0.0.1", port), timeout=SERVED_S) as sock:
            sock.sendall(bytes([0]) + struct.pack("<I", 0x3C85F7CE)
                         + bytes([13]) + struct.pack("<I", 77))
            assert sock.recv(4) == struct.pack("<I", 77)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        client.set("after", "flood")
        assert client.get("after") == b"flood"
    finally:
        child.kill()
        child.wait()


def test_the_agents_worker_channel(tmp_path):
    """Strangers of the agent's own user: hung up on at once, whatever they send."""
    workers: set[int] = set()
    got = []

    def on_message(msg):
        got.append(msg)
        return {"ok": True}

    path = str(tmp_path / "agent.sock")
    channel = Channel(path, on_message=on_message, admit=lambda pid: pid in workers)

    try:
        lure = b'{"type": "step", "rank": 0, "step": ' + b"9" * 4096  # a line never ended
        assert_flat(flood(path, lure, psutil.Process()))
        assert got == []
        workers.add(os.getpid())  # now one of its workers
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(SERVED_S)
            sock.connect(path)
            sock.sendall(b'{"type": "hello"}\n')
            assert json.loads(sock.recv(1 << 10)) == {"ok": True}
        assert got == [{"type": "hello"}]
    finally:
        channel.close()


def test_the_daemons_api(etcd, keys):
    server, port = api.serve(etcd, keys, address="127.0.0.1:0", token=TOKEN)
    auth = [("authorization", f"Bearer {TOKEN}")]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # warm: grpc's own threads
            pb_grpc.LazarusStub(ch).GetRunHealth(pb.GetRunHealthRequest(), metadata=auth,
                                                 timeout=SERVED_S)
        # HTTP/2's preface and a SETTINGS frame, then never a call
        lure = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
        assert_flat(flood(("127.0.0.1", port), lure, psutil.Process()))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.LazarusStub(ch)
            stub.GetRunHealth(pb.GetRunHealthRequest(), metadata=auth, timeout=SERVED_S)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetRunHealth(pb.GetRunHealthRequest(), timeout=SERVED_S)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(grace=0).wait()


def test_the_daemons_metrics_port(etcd, keys):
    tel = telemetry.start(telemetry.TelemetryConfig(metrics_port=0), etcd, keys,
                          served_by="flood")
    url = f"http://127.0.0.1:{tel.metrics_port}/metrics"
    try:
        urllib.request.urlopen(url, timeout=SERVED_S).read()
        lure = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # headers never ended
        flooded = flood(("127.0.0.1", tel.metrics_port), lure, psutil.Process())
        assert urllib.request.urlopen(url, timeout=SERVED_S).status == 200
        assert_flat(flooded)
    finally:
        tel.shutdown()
