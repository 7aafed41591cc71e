"""The collective part of preflight: an all-reduce whose result is checked and whose bus
bandwidth is measured, on a process group made for it alone (the agent's process has no
default group, and must not get one).

The requesting side runs in a child process (`python -m lazarus.agent.collective_check`),
killed when it overruns: NCCL would leave CUDA contexts on the agent's GPUs for as long as it
lives, and its watchdog aborts the whole process on a timeout. Gloo takes the same path, so
that the tests without GPUs run it. The child also ends when its parent does (its stdin
closes), never outliving an agent with a hung NCCL in it.

Three shapes:

    collective(peers, rank)   ranks at HOST:PORT each; those at this node's address run here,
                              in threads. Two at one address: the node's own stack, over its
                              own address (gloo; NCCL with two GPUs). Across nodes:
                              `lazarus preflight --peers`, one process per node.
    with_peer(...)            an idle node against one member of the current round, through
                              that member's agent, which serves such tests (`PeerTests`) on
                              the store every agent hosts: the path a promotion would use,
                              tested before the node is chosen, off every recovery's path.
                              Always gloo: NCCL would take GPU memory of a training node.
    PeerTests                 the serving side, polled by every agent.

A requester bumps a counter in the serving agent's store and waits for that agent's
acknowledgement under the new number; then both join a two-rank group under that number's
prefix. No acknowledgement within ACK_S means the peer does not serve them (an agent with
preflight off, an older one): the test is skipped, not failed.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from lazarus.agent.dcpprobe import checkpoint_round_trip
from lazarus.core import etcd as E
from lazarus.core.contract import DEVICE_ENV

log = logging.getLogger(__name__)

MiB = 1 << 20
_ITERS = 5
REQUESTS = "lazarus/preflight/requests"
ACK_S = 5.0
# A requester asks for at most this much: it costs the serving node's CPU and network.
MAX_PEER_BYTES = 64 * MiB
# Peer tests an agent serves at once, and the newest request numbers it looks at: the store is
# open to anyone, and each test holds a thread (and a gloo group) for up to its timeout.
SERVING = 2
PENDING = 4
# The child's time to start on top of the test's own timeout: a cold torch import on a busy
# node takes seconds (5-12 s seen for four agents starting together).
CHILD_START_S = 30.0
# What the child prints before its verdict: NCCL_DEBUG's lines go to stdout too.
_RESULT = "lazarus-collective-result "


def collective(peers: Sequence[str], rank: int, *, nbytes: int, min_bus_gbps: float,
               timeout_s: float = 30.0, zygote=None) -> tuple[bool, str]:
    """All-reduce `nbytes` between the ranks at `peers` (HOST:PORT each; rank 0's hosts the
    rendezvous store on its port). With one address given twice, both ranks run here, in one
    child process (NCCL when it sees a GPU per rank), which gets `timeout_s` for the test
    and CHILD_START_S to start before it is killed."""
    return in_child("collective", {"peers": list(peers), "rank": rank, "nbytes": nbytes,
                                   "min_bus_gbps": min_bus_gbps, "timeout_s": timeout_s},
                    timeout_s + CHILD_START_S, zygote=zygote)


def with_peer(peer: str, store_host: str, store_port: int, *, host: str, nbytes: int,
              min_bus_gbps: float, timeout_s: float = 30.0,
              ack_s: float = ACK_S, zygote=None) -> tuple[bool, str]:
    """Rank 1 of a gloo all-reduce with `peer`'s agent (rank 0), which hosts the store at
    `store_host:store_port`; this node's side binds `host`, in a child process (as
    `collective`)."""
    return in_child("with_peer", {"peer": peer, "store_host": store_host,
                                  "store_port": store_port, "host": host, "nbytes": nbytes,
                                  "min_bus_gbps": min_bus_gbps, "timeout_s": timeout_s,
                                  "ack_s": ack_s},
                    timeout_s + ack_s + CHILD_START_S, zygote=zygote)


def checkpoint(directory: str, *, zygote, user=None, env: dict | None = None
               ) -> tuple[bool, str]:
    """The checkpoint round trip (lazarus.agent.preflight) in a child forked from the agent's
    zygote: the agent itself then never loads torch. Without a zygote, a cold child, as
    `user` with `env` when the ranks run as a user of their own (lazarus.core.jobuser): the
    test writes in the job's directory, which the agent must not do as itself."""
    return in_child("checkpoint", {"directory": directory}, CHILD_START_S, zygote=zygote,
                    user=user, env=env)


def _checkpoint(directory: str) -> tuple[bool, str]:
    return checkpoint_round_trip(Path(directory))


def child_command() -> list[str]:
    """What runs a test's requesting side: this module, by the agent's own interpreter."""
    return [sys.executable, "-m", __name__]


def in_child(test: str, args: dict, limit_s: float, *, zygote=None, user=None,
             env: dict | None = None) -> tuple[bool, str]:
    """Run `test` with `args` in a child process and return its verdict; a child that has
    none within `limit_s` is killed, and one that dies is a failure with its last words.
    With the agent's `zygote` (lazarus.agent.zygote) the child is forked from it, which has
    imported torch already (docs/constraints.md, "Worker starts"); else a cold one."""
    request = json.dumps({"test": test, **args})
    # Files, not pipes: a chatty child (NCCL_DEBUG=INFO) must not block on a full pipe
    # while this side waits for its exit.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = None if zygote is None else zygote.run(
            __name__, [request], stdout=out.fileno(), stderr=err.fileno())
        if child is None:
            child = subprocess.Popen([*child_command(), request], stdin=subprocess.PIPE,
                                     stdout=out, stderr=err, env=env,
                                     **(user.popen_kwargs() if user is not None else {}))
        try:
            child.wait(limit_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return False, f"no result within {limit_s:.0f} s (the test's process was killed)"
        finally:
            child.stdin.close()  # its lifeline (`_main`)
        out.seek(0)
        err.seek(0)
        lines = out.read().decode(errors="replace").splitlines()
        result = next((line[len(_RESULT):] for line in reversed(lines)
                       if line.startswith(_RESULT)), None)
        if child.returncode == 0 and result is not None:
            ok, reason = json.loads(result)
            return ok, reason
        last = err.read().decode(errors="replace").strip().splitlines()[-1:]
        code = child.returncode
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}")
        return False, f"the test's process died ({how})" + (f": {last[0]}" if last else "")


def _main(request: str) -> None:
    """The child: run the test `request` names, print its verdict, and leave without
    joining torch's threads (a gloo group's, a store's: an unjoined C++ thread aborts the
    exit) -- or as soon as the parent is gone."""
    def lifeline() -> None:
        sys.stdin.buffer.read()  # EOF: the agent ended or gave up on this test
        os._exit(3)

    threading.Thread(target=lifeline, daemon=True).start()
    args = json.loads(request)
    test = {"collective": _collective, "with_peer": _with_peer,
            "checkpoint": _checkpoint}[args.pop("test")]
    try:
        ok, reason = test(**args)
    except Exception as e:  # a failed test's verdict, with the reason
        ok, reason = False, _first_line(e)
    print(_RESULT + json.dumps([ok, reason]), flush=True)
    os._exit(0)


def _collective(peers: Sequence[str], rank: int, *, nbytes: int, min_bus_gbps: float,
                timeout_s: float) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    world = len(peers)
    host0, port0 = _endpoint(peers[0])
    local = [r for r in range(world) if peers[r] == peers[rank]]
    backend = "nccl" if (torch.cuda.is_available() and torch.cuda.device_count() >= len(local)
                         and os.environ.get(DEVICE_ENV, "").lower() != "cpu") else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # rank 0's side hosts the store; every rank, here or there, has a connection of its own
    master = (dist.TCPStore(host0, port0, world_size=world, is_master=True, timeout=timeout,
                            wait_for_workers=False) if 0 in local else None)
    if port0 == 0:  # every rank here (loopback_peers): the store took a port of its choosing
        assert master is not None, "port 0 is for a test whose ranks are all on this node"
        port0 = master.port
    results: dict[int, float | BaseException] = {}

    def run(r: int) -> None:
        try:
            store = dist.TCPStore(host0, port0, is_master=False, timeout=timeout)
            results[r] = allreduce(dist.PrefixStore("lazarus/preflight/", store), r, world,
                                   backend=backend, nbytes=nbytes, timeout_s=timeout_s,
                                   host=_endpoint(peers[r])[0], device=local.index(r))
        except BaseException as e:  # a rank's failure is this check's verdict
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in local]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    del master  # kept open until every local rank is done with it
    for r in local:
        res = results.get(r)
        if res is None:
            return False, f"rank {r}: no result within {timeout_s:.0f} s"
        if isinstance(res, BaseException):
            return False, f"{backend} rank {r}: {_first_line(res)}"
    return _judge(backend, nbytes, world, max(results[r] for r in local), min_bus_gbps,
                  f"over {world} ranks")


def _with_peer(peer: str, store_host: str, store_port: int, *, host: str, nbytes: int,
               min_bus_gbps: float, timeout_s: float, ack_s: float) -> tuple[bool, str]:
    import torch.distributed as dist

    client = dist.TCPStore(store_host, store_port, is_master=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    n = client.add(REQUESTS, 1)
    prefix = f"lazarus/preflight/{n}/"
    client.set(f"lazarus/preflight/request/{n}", json.dumps({"bytes": nbytes}))
    try:
        client.wait([prefix + "ack"], datetime.timedelta(seconds=ack_s))
    except RuntimeError:  # torch's DistStoreError: a timeout
        return True, f"skipped: {peer} does not serve collective tests"
    seconds = allreduce(dist.PrefixStore(prefix, client), 1, 2, backend="gloo", nbytes=nbytes,
                        timeout_s=timeout_s, host=host, device=0)
    return _judge("gloo", nbytes, 2, seconds, min_bus_gbps, f"with {peer}")


class PeerTests:
    """Serves other nodes' `with_peer` tests on this agent's store: `poll` (the agent's loop,
    twice a second) hands each new request to a thread of its own, at most SERVING at once.

    The store takes anyone's writes (docs/security.md), so a request is judged before it
    costs anything: of the numbers new since the last poll only the PENDING newest are
    looked at (a requester takes the newest), one is served only once its record is there
    and valid, and one whose record has not come within ACK_S (the requester has given up)
    is forgotten. What cannot be served is dropped with one log line per poll; the
    requester's test is then skipped, never failed."""

    def __init__(self, store, *, host: str, port: int, timeout_s: float = 30.0):
        self.store, self.host, self.port, self.timeout_s = store, host, port, timeout_s
        self._seen = 0
        self._pending: dict[int, float] = {}   # request number -> when it was first seen
        self._slots = threading.Semaphore(SERVING)

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        try:
            self._poll(now)
        except RuntimeError as e:  # torch's DistError: tried again next poll
            log.warning("collective tests: store unreadable: %s", _first_line(e))

    def _poll(self, now: float) -> None:
        raw = self._read(REQUESTS)
        requested = _counter(raw) if raw is not None else 0
        if requested is None:
            # Only someone else's `set` makes this; requesters' `add` would fail on it.
            log.warning("collective tests: ignoring a malformed request counter %r", raw[:32])
            self.store.set(REQUESTS, str(self._seen))
            return
        if requested < self._seen:
            self._seen = requested   # set back by someone: followed from where it is now
        dropped = max(0, requested - self._seen - PENDING)
        self._pending.update(dict.fromkeys(range(self._seen + 1 + dropped, requested + 1), now))
        self._seen = requested
        for n in sorted(self._pending)[:-PENDING]:
            del self._pending[n]
            dropped += 1
        for n, since in sorted(self._pending.items()):
            record = self._read(f"lazarus/preflight/request/{n}")
            if record is None:
                if now - since > ACK_S:
                    del self._pending[n]   # its requester has given up
                continue
            del self._pending[n]
            nbytes = _requested_bytes(record)
            if nbytes is None:
                log.info("collective test %d ignored: malformed request %r", n, record[:64])
            elif not self._slots.acquire(blocking=False):
                dropped += 1
            else:
                try:
                    threading.Thread(target=self._serve, args=(n, nbytes), daemon=True,
                                     name=f"peer-test-{n}").start()
                except RuntimeError:   # no thread to be had: the slot is not taken
                    self._slots.release()
                    raise
        if dropped:
            log.warning("collective tests: dropped %d requests (at most %d served at once)",
                        dropped, SERVING)

    def _read(self, key: str) -> bytes | None:
        """`key`'s value, None when there is none, without blocking. Never `add`: on a value
        that is no number the store closes the connection it came on, here the agent's own."""
        return self.store.get(key) if self.store.check([key]) else None

    def _serve(self, n: int, nbytes: int) -> None:
        import torch.distributed as dist

        started = time.monotonic()
        try:
            client = dist.TCPStore(self.host, self.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
            client.set(f"lazarus/preflight/{n}/ack", "1")
            allreduce(dist.PrefixStore(f"lazarus/preflight/{n}/", client), 0, 2,
                      backend="gloo", nbytes=nbytes, timeout_s=self.timeout_s, host=self.host,
                      device=0)
            client.delete_key(f"lazarus/preflight/request/{n}")
            log.info("served collective test %d (%d MiB) in %.2f s", n, nbytes // MiB,
                     time.monotonic() - started)
        except Exception as e:  # the requester's verdict, not this agent's business
            log.info("collective test %d not served: %s", n, _first_line(e))
        finally:
            self._slots.release()


def _counter(raw: bytes) -> int | None:
    """The request counter's value; None when it is no number (`add` writes decimal)."""
    try:
        return int(raw) if len(raw) <= 20 else None
    except ValueError:
        return None


def _requested_bytes(record: bytes) -> int | None:
    """The bytes a request record asks for (`{"bytes": N}`, as `_with_peer` writes it),
    capped at MAX_PEER_BYTES; None for anything else."""
    try:
        req = json.loads(record) if len(record) <= 256 else None
    except ValueError:
        return None
    nbytes = req.get("bytes") if isinstance(req, dict) else None
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 4:
        return None
    return min(nbytes, MAX_PEER_BYTES)


def allreduce(store, rank: int, world: int, *, backend: str, nbytes: int, timeout_s: float,
              host: str, device: int) -> float:
    """Seconds per all-reduce of `nbytes`, on a group of its own over `store`; the result is
    checked."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        tensor = torch.ones(nbytes // 4, device=f"cuda:{device}")
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        pg = dist.ProcessGroupGloo(store, rank, world, opts)
        tensor = torch.ones(nbytes // 4)
    pg.allreduce([tensor]).wait()       # the connections are made on the first
    tensor.fill_(1.0)
    start = time.perf_counter()
    for _ in range(_ITERS):
        pg.allreduce([tensor]).wait()
    if backend == "nccl":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / _ITERS
    value = float(tensor[0])
    if value != float(world) ** _ITERS:
        raise RuntimeError(f"all-reduce gave {value}, expected {float(world) ** _ITERS}")
    return seconds


def _judge(backend: str, nbytes: int, world: int, seconds: float, min_bus_gbps: float,
           between: str) -> tuple[bool, str]:
    bus = nbytes * 2 * (world - 1) / world / seconds / 1e9
    text = f"{backend} all-reduce of {nbytes // MiB} MiB {between}: {bus:.2f} GB/s bus bandwidth"
    if bus < min_bus_gbps:
        return False, f"{text}, below {min_bus_gbps:g} GB/s"
    return True, text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)


def _endpoint(peer: str) -> tuple[str, int]:
    """A peer's 'host:port'; port 0 only as loopback_peers writes it."""
    host, _, port = peer.rpartition(":")
    return (host, 0) if port == "0" else E.parse_endpoint(peer)


def loopback_peers(host: str) -> tuple[str, str]:
    """Two ranks on this node, meeting on a port of its address that the store binds itself
    (port 0): a port found free first and bound later was taken meanwhile by another process
    on a busy host (EADDRINUSE: a healthy node failed its preflight and was cordoned)."""
    return (f"{host}:0", f"{host}:0")


if __name__ == "__main__":
    _main(sys.argv[1])
