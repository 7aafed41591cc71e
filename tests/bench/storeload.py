"""A round's store under N simulated ranks (tests/bench/bench_round_scale.py): N client
connections to one torch TCPStore, each doing what a rank of ours does to join a round
before its process groups -- connect, publish its address, count itself in, wait until the
whole world has, read its ring neighbours' addresses -- from several processes of many
threads, with nothing else of a rank (no gloo, no model).

With `ids`, each simulated rank does instead what torch's ProcessGroupNCCL does on the store
to make one communicator of WORLD ranks past TORCH_NCCL_RANKS_PER_ROOT (128) of them, where
NCCL (2.23+) bootstraps from several roots (ncclCommInitRankScalable): every 128th rank
publishes a 128-byte unique id, and every rank reads all ceil(WORLD / 128) of them in one
multi-get -- WORLD x ceil(WORLD / 128) x 128 bytes out of the one loop thread, per
communicator.

`python -m tests.bench.storeload HOST PORT FIRST COUNT WORLD [ids]` runs ranks
FIRST..FIRST+COUNT-1 once told to go (a line on stdin, after it printed "ready"), and prints
one JSON line: how long its ranks took from the go to their last read, the connects and
operations made, the bytes read."""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tests.bench.scalemodel import NCCL_ID_BYTES, RANKS_PER_ROOT

# What one rank sends the store, in order (the ops a rank's rendezvous makes here; gloo's own
# full-mesh exchange of each process group comes on top and is counted apart).
OPS_PER_RANK = 5  # set, add, wait, get, get


def rank_rendezvous(host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
    store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    store.set(f"addr/{rank}", f"10.0.{rank >> 8 & 255}.{rank & 255}:29500")
    if store.add("joined", 1) == world:
        store.set("all", "1")
    store.wait(["all"])
    store.get(f"addr/{(rank + 1) % world}")
    store.get(f"addr/{(rank - 1) % world}")


def rank_nccl_ids(host: str, port: int, rank: int, world: int, timeout_s: float) -> int:
    """One rank's part of a scalable communicator init, on a connection of its own."""
    return nccl_ids(dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout_s)), rank, world)


def nccl_ids(store: dist.Store, rank: int, world: int) -> int:
    """What rank `rank` of `world` asks of the store to make one communicator with torch's
    scalable NCCL init (a root publishes its id first); returns the bytes it read."""
    keys = [f"UniqueNCCLID:{r}" for r in range(-(-world // RANKS_PER_ROOT))]
    if rank % RANKS_PER_ROOT == 0:
        store.set(keys[rank // RANKS_PER_ROOT], bytes(NCCL_ID_BYTES))
    got = store.multi_get(keys)
    return sum(len(v) for v in got)


def main(argv: list[str]) -> None:
    host, port, first, count, world = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    ids = argv[5:] == ["ids"]
    errors: list[str] = []
    print("ready", flush=True)
    sys.stdin.readline()  # "go": every process has imported torch, and they start together
    started = time.perf_counter()
    read: list[int] = []  # bytes each rank read (list.append is atomic)

    def run(r: int) -> None:
        try:
            if ids:
                read.append(rank_nccl_ids(host, port, r, world, timeout_s=600))
            else:
                rank_rendezvous(host, port, r, world, timeout_s=600)
        except Exception as e:  # a failure is the figure's, reported
            errors.append(f"rank {r}: {e}")

    threads = [threading.Thread(target=run, args=(r,), daemon=True)
               for r in range(first, first + count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ops = (count + sum(1 for r in range(first, first + count) if r % RANKS_PER_ROOT == 0)
           if ids else count * OPS_PER_RANK)
    print(json.dumps({"ranks": count, "s": time.perf_counter() - started, "connects": count,
                      "ops": ops, "bytes_read": sum(read), "errors": errors[:3]}))


if __name__ == "__main__":
    main(sys.argv[1:])
