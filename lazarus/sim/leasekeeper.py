"""The simulated fleet's lease keep-alives, in a process of their own.

Thousands of simulated agents share one Python process (lazarus.sim.fleet), whose bursts of
work -- a round of 32,768 ranks starting, every node writing its status at once -- would hold
the interpreter long enough for keep-alives to run late, and a late keep-alive is a node loss
that never happened. Here nothing else runs: every lease named on stdin is renewed every TTL/3
in batches on keep-alive streams (one stream renews thousands), and leases etcd no longer
knows are named on stdout.

    stdin   "+ID" keep lease ID (hex) alive, "-ID" stop (the node died), EOF: exit
    stdout  "lost ID ..." leases etcd did not renew; "late S" a renewal round that started
            S seconds behind its schedule (more than a tenth of the TTL)

Run as `python -m lazarus.sim.leasekeeper ENDPOINT TTL_S [--etcd-ca ...]` (the fleet starts
it, with its own etcd flags).
"""

from __future__ import annotations

import argparse
import os
import selectors
import sys
import time

from aetcd import rpc

from lazarus.core import etcd as E
from lazarus.core import settings
from lazarus.core.etcd_auth import EtcdAuth

# Leases renewed per keep-alive stream: etcd answers a stream's requests one by one, in order.
PER_STREAM = 2048


async def _renew(client, leases: list[int], timeout_s: float) -> dict[int, int]:
    """lease -> remaining TTL (<= 0: etcd no longer knows it)."""
    await client.connect()
    ttls: dict[int, int] = {}
    requests = iter([rpc.LeaseKeepAliveRequest(ID=lease) for lease in leases])
    async for reply in client.leasestub.LeaseKeepAlive(requests, timeout=timeout_s,
                                                       metadata=client.metadata):
        ttls[reply.ID] = reply.TTL
        if len(ttls) == len(leases):
            break
    return ttls


def keep(endpoint: str, ttl_s: float, auth: EtcdAuth | None = None) -> None:
    etcd = E.Etcd(endpoint, auth=auth)
    live: set[int] = set()
    period = ttl_s / 3
    due = time.monotonic() + period
    sel = selectors.DefaultSelector()
    fd = sys.stdin.fileno()
    sel.register(fd, selectors.EVENT_READ)
    pending = b""
    try:
        while True:
            if sel.select(max(0.0, due - time.monotonic())):
                data = os.read(fd, 1 << 16)
                if not data:
                    return
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    lease = int(line[1:], 16)
                    (live.add if line[:1] == b"+" else live.discard)(lease)
                continue
            late = time.monotonic() - due
            due += period
            if late > ttl_s / 10:
                print(f"late {late:.3f}", flush=True)
                due = time.monotonic() + period
            leases = list(live)
            lost = []
            for i in range(0, len(leases), PER_STREAM):
                batch = leases[i:i + PER_STREAM]
                try:
                    # Etcd has no call for a batch of renewals; its loop, member failover and
                    # error mapping serve this one.
                    ttls = etcd._run(lambda c, b=batch: _renew(c, b, etcd.timeout_s))
                except E.EtcdUnavailable:
                    continue  # etcd away: its lease timers restart when it is back
                lost += [lease for lease, ttl in ttls.items() if ttl <= 0]
            if lost:
                live.difference_update(lost)
                print("lost " + " ".join(f"{lease:x}" for lease in lost), flush=True)
    finally:
        etcd.close()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m lazarus.sim.leasekeeper")
    p.add_argument("endpoint")
    p.add_argument("ttl_s", type=float)
    settings.add_etcd_security_args(p)
    args = p.parse_args(argv)
    keep(args.endpoint, args.ttl_s, settings.etcd_auth(args))


if __name__ == "__main__":
    main(sys.argv[1:])
