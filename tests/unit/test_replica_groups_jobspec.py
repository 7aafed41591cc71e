"""[job] failure_unit and replicas (docs/replicas.md): the default is unchanged, the opt-in
mode is read and kept, and bad values get one clear line."""

import pytest

from lazarus.core.errors import UserError
from lazarus.core.jobspec import JobSpec, from_dict

TRAIN = {"model": {"name": "tiny"}, "data": {"global_batch": 8}}


def _job(**job):
    return from_dict({"job": {"name": "r", "nodes": 4, **job}, "train": TRAIN}, source="job.toml")


def test_default_is_the_whole_world():
    spec = _job()
    assert (spec.failure_unit, spec.replicas) == ("world", 1)


def test_replica_mode_is_read_accepted_and_survives_the_record():
    doc = {"job": {"name": "r", "nodes": 4, "failure_unit": "replica", "replicas": 2},
           "train": TRAIN}
    spec = from_dict(doc, source="job.toml")
    assert (spec.failure_unit, spec.replicas) == ("replica", 2)
    back = JobSpec.from_json(spec.to_json())
    assert (back.failure_unit, back.replicas) == ("replica", 2)
    # Each round trains one replica's world: dp for its 2 nodes of 1 rank.
    assert spec.train_config_for(spec.nodes // spec.replicas)["parallelism"]["dp"] == 2


@pytest.mark.parametrize("job, message", [
    ({"failure_unit": "node"}, 'failure_unit must be "world" or "replica"'),
    ({"failure_unit": 1}, 'failure_unit must be "world" or "replica"'),
    ({"failure_unit": "replica", "replicas": 3}, "replicas = 3 must divide nodes = 4"),
    ({"failure_unit": "replica", "replicas": 1}, "needs replicas >= 2"),
    ({"failure_unit": "replica"}, "needs replicas >= 2"),
    ({"replicas": 2}, 'needs failure_unit = "replica"'),
    ({"failure_unit": "replica", "replicas": 0}, "replicas must be an integer >= 1"),
    ({"failure_unit": "replica", "replicas": "2"}, "replicas must be an integer >= 1"),
    ({"failure_unit": "replica", "replicas": True}, "replicas must be an integer >= 1"),
    # What replica mode does not run yet, said as such
    ({"failure_unit": "replica", "replicas": 2, "command": ["python", "train.py"]},
     "runs the built-in trainer only"),
    ({"failure_unit": "replica", "replicas": 2, "min_nodes": 2},
     r"needs min_nodes = nodes \(4\), got min_nodes = 2"),
])
def test_bad_values_are_one_clear_line(job, message):
    with pytest.raises(UserError, match=message) as e:
        _job(**job)
    assert "\n" not in str(e.value) and str(e.value).startswith("job.toml: ")


def test_a_replica_job_may_checkpoint_to_storage_but_takes_no_tier_0():
    doc = {"job": {"name": "r", "nodes": 4, "failure_unit": "replica", "replicas": 2},
           "train": {**TRAIN, "checkpoint": {"dir": "/ckpt", "every": 50}}}
    spec = from_dict(doc, source="job.toml")
    assert spec.train["checkpoint"] == {"dir": "/ckpt", "every": 50}
    # tier 0 left at its default (or off) is accepted; asked for, it is one clear line
    for every in (0, -1):
        doc["train"]["checkpoint"]["memory_every"] = every
        from_dict(doc, source="job.toml")
    doc["train"]["checkpoint"]["memory_every"] = 5
    with pytest.raises(UserError, match=r"takes no tier-0 snapshots \(a live replica is "
                                        r"already a copy in memory") as e:
        from_dict(doc, source="job.toml")
    assert "\n" not in str(e.value) and "memory_every = 5" in str(e.value)
    # the same file in world mode runs as before
    del doc["job"]["failure_unit"], doc["job"]["replicas"]
    assert from_dict(doc, source="job.toml").train["checkpoint"]["memory_every"] == 5


@pytest.mark.parametrize("nodes, replicas, nproc, tp, batch, message", [
    # 2 replicas x (2 nodes x 2 ranks) = dp 4 each: 8 shares, 12 does not split
    (4, 2, 2, 1, 12, r"global_batch = 12 must be divisible by replicas x dp = 2 x 4 = 8"),
    # tp 2 inside each node: dp 2 per replica, 4 shares
    (4, 2, 2, 2, 6, r"global_batch = 6 must be divisible by replicas x dp = 2 x 2 = 4"),
    (6, 3, 1, 1, 4, r"global_batch = 4 must be divisible by replicas x dp = 3 x 2 = 6"),
])
def test_the_global_batch_must_split_over_every_replica_s_ranks(nodes, replicas, nproc, tp,
                                                                 batch, message):
    doc = {"job": {"name": "r", "nodes": nodes, "nproc_per_node": nproc,
                   "failure_unit": "replica", "replicas": replicas},
           "train": {"model": {"name": "tiny"}, "data": {"global_batch": batch},
                     "parallelism": {"tp": tp}}}
    with pytest.raises(UserError, match=message):
        from_dict(doc, source="job.toml")
    doc["train"]["data"]["global_batch"] = batch * replicas * nproc * nodes
    spec = from_dict(doc, source="job.toml")
    per = spec.train_config_for(nodes // replicas)["parallelism"]
    assert per["dp"] * tp == nodes // replicas * nproc
