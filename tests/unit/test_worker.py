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


@pytest.mark.parametrize("issued_at, seconds", [
    (97.5, 2.5),                  # handed over 2.5 s before the rank took it
    (0.0, 0.0),                   # an agent that does not say
    ("soon", 0.0), (None, 0.0), (True, 0.0), (float("nan"), 0.0),
    (120.0, 0.0),                 # from the future: the clocks disagree
    (100.0 - 10_000, 0.0),        # hours ago: a clock stepped, not a wait
])
def test_the_handover_is_read_from_the_assignment_and_garbage_is_none(issued_at, seconds):
    from lazarus.trainer.worker import handover_s

    assert handover_s(issued_at, now=100.0) == seconds
