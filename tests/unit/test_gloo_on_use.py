"""The checkpointer's gloo group is made on use (lazarus.trainer.glooinit): made, it holds no
connection of its own, where made eagerly it was a full mesh of the world; used, it works.
Three real ranks on gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from lazarus.trainer.glooinit import LAZY_ENV, made_on_use

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import os, socket, sys
from datetime import timedelta
import torch.distributed as dist
from lazarus.trainer import exchange
from lazarus.trainer.ckptsave import Checkpointer

def connections():
    # to peers: the store's are not the group's (torch may dial the store again)
    n = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                n += s.getpeername()[1] != port
        except OSError:
            pass
        finally:
            s.close()
    return n

rank, world, port, root = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=dist.PrefixStore("t", store), rank=rank, world_size=world)
before = connections()
ckpt = Checkpointer(root, keep_last=1)
made = connections()
# a rank ahead would connect to this one in its broadcast: count everywhere first
dist.barrier()
got = exchange.broadcast(f"from {rank}", src=0, group=ckpt._pg)
print(made - before, got, os.environ.get("TORCH_GLOO_LAZY_INIT"), flush=True)
dist.barrier()
"""


def test_the_checkpointers_group_holds_no_connection_until_used(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    world = 3
    env = {k: v for k, v in os.environ.items() if k != LAZY_ENV}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), str(store.port),
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env)
             for r in range(world)]
    outs = []
    for p in ranks:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        outs.append(out.split())
    # no connection made with the group (eager: 2 a rank); the broadcast reached every rank;
    # the process's own setting is as it was (unset)
    assert outs == [["0", "from", "0", "None"]] * world


def test_the_operators_setting_wins():
    os.environ[LAZY_ENV] = "0"
    try:
        with made_on_use():
            assert os.environ[LAZY_ENV] == "0"
        assert os.environ[LAZY_ENV] == "0"
    finally:
        del os.environ[LAZY_ENV]
    with made_on_use():
        assert os.environ[LAZY_ENV] == "1"
    assert LAZY_ENV not in os.environ
