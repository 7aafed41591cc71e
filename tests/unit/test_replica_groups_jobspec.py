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


def test_replica_mode_is_read_and_survives_the_record_but_not_run_yet():
    doc = {"job": {"name": "r", "nodes": 4, "failure_unit": "replica", "replicas": 2},
           "train": TRAIN}
    with pytest.raises(UserError, match='failure_unit = "replica" is not run by this daemon'):
        from_dict(doc, source="job.toml")
    spec = from_dict(doc, source="job.toml", check_sizes=False)
    assert (spec.failure_unit, spec.replicas) == ("replica", 2)
    back = JobSpec.from_json(spec.to_json())
    assert (back.failure_unit, back.replicas) == ("replica", 2)


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
])
def test_bad_values_are_one_clear_line(job, message):
    with pytest.raises(UserError, match=message) as e:
        _job(**job)
    assert "\n" not in str(e.value) and str(e.value).startswith("job.toml: ")
