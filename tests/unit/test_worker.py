"""The worker assignment: the JSON contract between the agent (or launcher) and a rank."""

import pytest

from lazarus.core.errors import UserError
from lazarus.core.trainconfig import ModelSpec, ParallelConfig, TrainConfig
from lazarus.core.contract import WorkerAssignment


def test_assignment_round_trips_through_json():
    train = TrainConfig(model=ModelSpec(name="tiny"), parallelism=ParallelConfig(dp=2, tp=2)).to_dict()
    a = WorkerAssignment(rank=3, world_size=4, local_rank=1, round=12, store_host="10.0.0.2", store_port=29500,
                         train=train, restore="/ckpt/step-00000100",
                         report_socket="/run/lazarus/agent.sock")
    assert WorkerAssignment.from_json(a.to_json()) == a


def test_optional_fields_default_and_mistakes_are_named():
    a = WorkerAssignment.from_json('{"rank": 0, "world_size": 1, "local_rank": 0, "round": 0, '
                                   '"store_host": "h", "store_port": 1, "train": {}}')
    assert a.restore is None and a.report_socket is None
    with pytest.raises(UserError, match=r"unknown keys \['ranks'\], missing keys \[.*'rank'"):
        WorkerAssignment.from_json('{"ranks": 0}')
    with pytest.raises(UserError, match="not JSON"):
        WorkerAssignment.from_json("rank=0")
