"""The built-in trainer's rank makes one connection a round to its agent's store: it reads the
round's port through it and makes its process groups through the same one
(lazarus.trainer.rankrun.agent_store), where it made two; a survivor's next round connects
anew. What a start costs the process is counted in connections and store requests
(lazarus.trainer.startcost). Real TCPStores; each case in a child process, as a rank is one."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from lazarus.core.contract import round_port_key

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import sys
from datetime import timedelta
from lazarus.core.contract import WorkerAssignment
from lazarus.trainer import rankrun
from lazarus.trainer.startcost import StartCost
port = int(sys.argv[1])
def assignment(round_):
    return WorkerAssignment(rank=0, world_size=1, local_rank=0, round=round_,
                            store_host="127.0.0.1", store_port=port, train={})
cost = StartCost(port, 1)
print(rankrun.round_port(assignment(1), keep=True))
# the trainer's groups go through the connection the port was read through
rankrun.agent_store("127.0.0.1", port, timedelta(seconds=60)).set("lazarus/round/1/x", "1")
first = cost.now()
print(first.connections, first.store_requests)
rankrun.drop_agent_store()  # the round is over (lazarus.trainer.inplace.survive)
cost = StartCost(port, 2)
print(rankrun.round_port(assignment(2), keep=True))
second = cost.now()
print(second.connections, second.store_requests)
# a script's rank reads the port on a connection of its own, kept by nothing
rankrun.drop_agent_store()
print(rankrun.round_port(assignment(1)), rankrun._kept is None)
"""


def test_a_round_reads_its_port_and_makes_its_groups_through_one_connection():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    for r, port in ((1, 4101), (2, 4102)):
        store.set(round_port_key(r), str(port))
    out = subprocess.run([sys.executable, "-c", RANK, str(store.port)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = out.stdout.split()
    assert got[0] == "4101"
    # one connection: its handshake (two requests), the port's get (two), the group's set
    assert got[1:3] == ["1", "5"]
    assert got[3:6] == ["4102", "1", "4"]  # the next round: a connection of its own
    assert got[6:8] == ["4101", "True"]
    assert store.get("lazarus/round/1/x") == b"1"
