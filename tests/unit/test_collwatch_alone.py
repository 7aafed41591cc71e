"""A rank alone in its world (one GPU, `--nproc-per-node 1`) reports its joining and no
collective count (trainer/collwatch.py): TorchTitan on one GPU issues no collective a step, so a
count would only ever look stalled -- a hang after the first-step timeout, a chaos clock that
never starts. A rank with peers goes on reporting its count. Real gloo groups, in a process
each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A rank's process: a gloo world of WORLD ranks, collwatch's loop with a session that records
# what it sends, one all-reduce, then the record.
RANK = r"""
import json, sys, threading, time
import torch, torch.distributed as dist
from lazarus.trainer import collwatch, session as sessions

class Recorder:
    connected = True
    def __init__(self): self.sent = []
    def joined(self): self.sent.append("joined")
    def progress(self, step, phase, seq, op=""): self.sent.append(f"progress {seq}")

rec = Recorder()
sessions.connect = lambda level=1, **kw: rec
rank, world, addr = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=world)
threading.Thread(target=collwatch._loop, args=(0.05,), daemon=True).start()
time.sleep(0.5)
dist.all_reduce(torch.ones(1))
time.sleep(0.5)
print(json.dumps(rec.sent))
dist.destroy_process_group()
"""


def _record(tmp_path, world: int) -> list[list[str]]:
    addr = f"file://{tmp_path}/store"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), addr],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_lone_rank_reports_its_joining_and_no_count(tmp_path, world):
    for sent in _record(tmp_path, world):
        assert sent[0] == "joined", sent
        if world == 1:
            assert sent == ["joined"], sent
        else:  # its count moves with the all-reduce
            assert len(sent) >= 3 and sent[-1] != sent[1], sent
