"""What `--replica-encrypt` costs a tier-0 copy (on demand):
`pytest tests/bench/bench_replica_encryption.py -m bench -s`.

One agent's replica server and a client in this process, over loopback: a put of a snapshot
of SIZE_MB of incompressible data, in the clear and encrypted, alternately, REPS times each;
the best of each and their ratio. Both sides share this machine's cores, so the figure is the
sender's and the receiver's costs together."""

from __future__ import annotations

import os
import time

import pytest

from lazarus.agent import replica
from lazarus.core import snapshotfile

pytestmark = pytest.mark.bench

SIZE_MB = int(os.environ.get("LAZARUS_BENCH_REPLICA_MB", "256"))
REPS = 3
KEY = os.urandom(32)


def test_encrypted_copies_cost_against_copies_in_the_clear():
    data = snapshotfile.pack({"job": "j", "round": 2, "rank": 1, "world_size": 2, "step": 5},
                             os.urandom(SIZE_MB << 20), min_saving=2.0)
    taken = []
    server = replica.ReplicaServer("127.0.0.1", key=KEY, accept=lambda *a: taken.append(a[:3]),
                                   find=lambda *a: None, max_bytes=len(data), node="n1")
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(REPS):
            for encrypt in (False, True):
                t0 = time.perf_counter()
                replica.push("127.0.0.1", server.port, KEY, node="n0", to="n1", job="j",
                             rank=1, step=5, data=data, round_=2, encrypt=encrypt)
                times[encrypt].append(time.perf_counter() - t0)
    finally:
        server.close()
    assert len(taken) == 2 * REPS
    mib = len(data) / (1 << 20)
    print(f"\n== a {mib:.0f} MiB tier-0 copy over loopback, best of {REPS} ==")
    for encrypt, ts in times.items():
        best = min(ts)
        print(f"{'encrypted' if encrypt else 'in the clear':>13}: {best:.3f} s "
              f"({mib / best:.0f} MiB/s)")
    print(f"encrypted / in the clear: {min(times[True]) / min(times[False]):.2f}x")
