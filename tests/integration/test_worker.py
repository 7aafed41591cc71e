"""A parked worker: imports done up front, it trains as soon as an assignment line arrives."""

import json
import os
import subprocess
import sys

import torch.distributed as dist

from lazarus.core.trainconfig import DataConfig, TrainConfig
from lazarus.core.contract import WorkerAssignment, round_port_key


def test_parked_worker_runs_the_assignment_it_is_given(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # as the agent hosting a round does: a store of the round's own, its port published
    round_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(round_port_key(7), str(round_store.port))
    worker = subprocess.Popen([sys.executable, "-m", "lazarus.cli", "worker", "--park"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert json.loads(worker.stdout.readline())["event"] == "parked"
        metrics = tmp_path / "m.jsonl"
        train = TrainConfig(steps=2, data=DataConfig(seq_len=32, global_batch=2), metrics=str(metrics)).to_dict()
        assignment = WorkerAssignment(rank=0, world_size=1, local_rank=0, round=7, store_host="127.0.0.1",
                                      store_port=store.port, train=train)
        worker.stdin.write(assignment.to_json() + "\n")
        worker.stdin.flush()
        assert worker.wait(timeout=120) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "kind" not in r] == [1, 2]
    (start,) = [r for r in rows if r.get("kind") == "start"]   # where its start went
    assert (start["round"], start["from"], start["step"]) == (7, "scratch", 0)
