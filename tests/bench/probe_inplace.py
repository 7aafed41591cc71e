"""What torch gives in-place recovery, measured (on demand; docs/inplace.md):

    .venv/bin/python -m tests.bench.probe_inplace            # gloo on CPU
    .venv/bin/python -m tests.bench.probe_inplace --nccl     # NCCL, one GPU per rank

Three ranks all-reduce in a loop; the probe then SIGKILLs or SIGSTOPs rank 2 while the others
wait in a collective with it, and asks the survivors to abort their process groups (a store
key, as an agent would tell them). For each fault it prints how long the survivors' blocked
collective took to fail after the fault (a kill resets the peer's sockets; a stopped peer
resets nothing, so only an abort that really cancels work releases it before the collective
timeout), how long the abort took, and how long the survivors took to re-create their
default group in the same process with a fresh rank 2 (round 2's store prefix).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

WORLD = 3
# Short, so that a collective the abort does not release ends inside the probe.
COLLECTIVE_TIMEOUT_S = 20


def _rank(rank: int, port: int, first_round: int, nccl: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    device = torch.device("cuda", rank % torch.cuda.device_count()) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    for round_ in (first_round, first_round + 1):
        started = time.monotonic()
        dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=WORLD,
                                store=dist.PrefixStore(f"round/{round_}", base),
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                                device_id=device if nccl else None)
        t = torch.ones(1 << 16, device=device)
        dist.all_reduce(t)  # the group is up (NCCL makes its communicator lazily)
        joined = time.monotonic() - started
        base.set(f"joined/{round_}/{rank}", f"{joined:.3f}")
        if round_ > 1:  # round 2: the survivors and the fresh rank met again
            base.set(f"resumed/{rank}", "1")
            os._exit(0)
        aborted = {}

        def watch() -> None:
            # A client of its own: a store client's blocking wait holds its socket.
            own = dist.TCPStore("127.0.0.1", port, is_master=False,
                                timeout=timedelta(seconds=120))
            own.wait([f"abort/{round_}"], timedelta(seconds=120))
            t0 = time.monotonic()
            c10d._abort_process_group()
            aborted["s"] = time.monotonic() - t0

        threading.Thread(target=watch, daemon=True).start()
        failed_at = None
        try:
            while True:
                dist.all_reduce(t)
                if nccl:
                    torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 -- any failure of the collective is the datum
            failed_at = time.time()
            base.set(f"failed/{rank}", f"{failed_at:.6f} {type(e).__name__}: "
                                       f"{str(e).splitlines()[0][:100]}")
        while "s" not in aborted:
            time.sleep(0.01)
        base.set(f"abort_s/{rank}", f"{aborted['s']:.4f}")
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 -- an aborted group may refuse: it is gone either way
            pass


def _probe(fault: str, port: int, nccl: bool) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    me = [sys.executable, "-m", "tests.bench.probe_inplace", "--rank"]
    flags = ["--nccl"] if nccl else []
    procs = [subprocess.Popen([*me, str(r), str(port), "1", *flags]) for r in range(WORLD)]
    try:
        store.wait([f"joined/1/{r}" for r in range(WORLD)], timedelta(seconds=120))
        time.sleep(1.0)  # well into the loop
        fault_at = time.time()
        procs[2].send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        time.sleep(0.2)  # an agent learns of a fault this fast at best
        store.set("abort/1", "1")
        fresh = subprocess.Popen([*me, "2", str(port), "2", *flags])
        store.wait([f"failed/{r}" for r in (0, 1)] + [f"abort_s/{r}" for r in (0, 1)],
                   timedelta(seconds=COLLECTIVE_TIMEOUT_S + 60))
        released = [float(store.get(f"failed/{r}").decode().split()[0]) - fault_at
                    for r in (0, 1)]
        store.wait([f"resumed/{r}" for r in range(WORLD)], timedelta(seconds=120))
        rejoin = [float(store.get(f"joined/2/{r}").decode()) for r in (0, 1)]
        fresh.wait(timeout=60)
        return {"fault": fault, "released_s": max(released),
                "how": store.get("failed/0").decode().split(" ", 1)[1],
                "abort_s": max(float(store.get(f"abort_s/{r}").decode()) for r in (0, 1)),
                "rejoin_s": max(rejoin)}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nccl", action="store_true")
    p.add_argument("--rank", nargs=3, metavar=("RANK", "PORT", "ROUND"), type=int)
    args = p.parse_args()
    if args.rank:
        _rank(*args.rank, nccl=args.nccl)
        return
    import torch
    print(f"torch {torch.__version__}, {'nccl' if args.nccl else 'gloo'}, world {WORLD}, "
          f"collective timeout {COLLECTIVE_TIMEOUT_S} s")
    print(f"{'fault':<6} {'survivors released after':>24} {'abort took':>11} "
          f"{'rejoin took':>12}  how the collective failed")
    for i, fault in enumerate(("kill", "stop")):
        r = _probe(fault, 29600 + i + (10 if args.nccl else 0), args.nccl)
        print(f"{r['fault']:<6} {r['released_s']:>22.2f} s {r['abort_s']:>9.3f} s "
              f"{r['rejoin_s']:>10.3f} s  {r['how']}")


if __name__ == "__main__":
    main()
