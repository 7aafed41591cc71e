"""A rank of a job of replica groups checks its mesh against its replica's world, not the
job's, and says in one line what does not fit (docs/replicas.md)."""

import pytest

from lazarus.core.contract import WorkerAssignment
from lazarus.core.errors import UserError
from lazarus.core.trainconfig import ParallelConfig, TrainConfig


@pytest.mark.parametrize("world, replicas, dp, tp, message", [
    (4, 2, 4, 1, "dp 4 x tp 1 = 4 ranks, but each of the 2 replicas of a world of 4 has 2"),
    (4, 3, 1, 1, "a world of 4 ranks cannot hold 3 equal replicas"),
    (4, 0, 4, 1, "a world of 4 ranks cannot hold 0 equal replicas"),
])
def test_a_mesh_that_does_not_fit_the_replica_is_refused(world, replicas, dp, tp, message):
    from lazarus.trainer.worker import run

    train = TrainConfig(parallelism=ParallelConfig(dp=dp, tp=tp)).to_dict()
    a = WorkerAssignment(rank=0, world_size=world, local_rank=0, round=3, store_host="127.0.0.1",
                         store_port=1, train=train, replicas=replicas, replica_epoch=3)
    with pytest.raises(UserError, match=message):
        run(a)
