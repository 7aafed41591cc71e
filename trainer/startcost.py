"""What a rank's start costs its process, in counts that do not depend on the machine's speed
(docs/scale.md): CPU-seconds (every thread of the process), the TCP connections it opened,
and the requests it sent to the round's store (one TCP data segment each: the store's client
sends a request in one write; a `get` is two, a wait and a read).

Counted from the assignment in hand to the end of setup (a survivor's part of a recovery:
StartTimes' handover, rendezvous, build, restore, setup), then through the first step (where
gloo groups made on use connect their pairs). The rank's log gets one line; the scale bench
(tests/bench/bench_round_scale.py) reads it.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

# struct tcp_info (linux/tcp.h): tcpi_data_segs_out, a u32, since Linux 4.6.
_DATA_SEGS_OUT = 156
_TCP_INFO_LEN = 160


def _tcp_sockets(store_port: int) -> dict[str, int]:
    """This process's connected TCP sockets: inode -> data segments sent, for those whose
    peer is on `store_port` (0 for the others)."""
    out: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                peer = s.getpeername()  # a listening or unconnected socket raises
                sent = 0
                if peer[1] == store_port:
                    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
                    if len(info) >= _DATA_SEGS_OUT + 4:
                        sent = struct.unpack_from("I", info, _DATA_SEGS_OUT)[0]
                out[link] = sent
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only
    return out


@dataclass(slots=True)
class Cost:
    cpu_s: float
    connections: int
    store_requests: int

    def text(self) -> str:
        return (f"{self.cpu_s:.3f} CPU-s, {self.connections} TCP connections opened, "
                f"{self.store_requests} store requests")


@dataclass(slots=True)
class StartCost:
    """Taken when the assignment is in hand; `hook` (a trainer phase hook) says the cost."""
    store_port: int
    round: int
    cpu0: float = field(default_factory=time.process_time)
    sockets0: dict[str, int] = field(init=False)
    _calls: int = 0
    to_setup: Cost | None = None

    def __post_init__(self) -> None:
        self.sockets0 = _tcp_sockets(self.store_port)

    def now(self) -> Cost:
        cpu = time.process_time() - self.cpu0
        sockets = _tcp_sockets(self.store_port)
        opened = [k for k in sockets if k not in self.sockets0]
        requests = sum(sent - self.sockets0.get(k, 0) for k, sent in sockets.items())
        return Cost(cpu, len(opened), requests)

    def hook(self, phase: str, ctx) -> None:
        """The first phase of the first step ends setup; the first phase of the second step
        ends the first step."""
        if self._calls > 1:
            return
        if self._calls == 1 and phase != "data":
            return
        self._calls += 1
        cost = self.now()
        if self._calls == 1:
            self.to_setup = cost
            return
        print(f"rank {ctx.rank} round {self.round}: the start cost this process {self.to_setup.text()} to setup; "
              f"{cost.text()} through the first step", file=sys.stderr, flush=True)
