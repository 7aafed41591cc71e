"""`python storeload_driver.py N PROCS [ids]`: one TCPStore here, N simulated ranks' rendezvous
(with `ids`: their reads of a scalable NCCL communicator's unique ids) against it from PROCS
processes (tests/bench/storeload.py), all started together once each has imported torch.
Prints one JSON line: N, the wall time from the go to the last rank's last read, the bytes
they read, and the CPU time this process's threads spent meanwhile (the store's loop thread
is nearly all of it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist


def _cpu_s() -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def main(n: int, procs: int, mode: list[str]) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    per = -(-n // procs)
    spans = [(first, min(per, n - first)) for first in range(0, n, per)]
    clients = [subprocess.Popen([sys.executable, "-m", "tests.bench.storeload", "127.0.0.1",
                                 str(server.port), str(first), str(count), str(n), *mode],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
               for first, count in spans]
    for c in clients:
        assert c.stdout.readline().strip() == "ready"
    cpu0, t0 = _cpu_s(), time.perf_counter()
    for c in clients:
        c.stdin.write("go\n")
        c.stdin.flush()
    outs = [json.loads(c.stdout.readline()) for c in clients]
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    for c in clients:
        c.wait()
    errors = [e for o in outs for e in o["errors"]]
    print(json.dumps({"ranks": n, "procs": len(clients), "wall_s": round(wall, 3),
                      "server_cpu_s": round(cpu, 3), "connects": sum(o["connects"] for o in outs),
                      "ops": sum(o["ops"] for o in outs),
                      "bytes_read": sum(o["bytes_read"] for o in outs), "errors": errors[:3]}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
