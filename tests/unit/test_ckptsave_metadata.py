"""The saver reads back DCP's `.metadata` when torch's save returns it without its storage
layout (trainer/ckptsave.py): that file sits on storage the job's ranks can write, so it is
read with the restricted unpickler (trainer/dcpread.py; docs/security.md, "A compromised
agent"). A pickle that would run code is refused, naming what it asked for, and runs nothing."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lazarus.core.errors import CheckpointError
from lazarus.trainer.ckptsave import _shard_files


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# A single-process save is intended here, not a mistake.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def saved(tmp_path) -> Path:
    directory = tmp_path / "step-00000001"
    dcp.save({"w": torch.zeros(4), "b": torch.ones(2)}, checkpoint_id=directory, no_dist=True)
    return directory


def test_an_honest_metadata_file_names_the_shards(saved):
    shards = _shard_files(saved, None)
    assert shards and all((saved / name).is_file() for name in shards), shards


def test_a_metadata_pickle_that_would_run_code_is_refused_and_runs_nothing(saved, tmp_path):
    marker = tmp_path / "ran"
    (saved / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError) as got:
        _shard_files(saved, None)
    assert "system is not allowed in DCP metadata" in str(got.value), got.value
    assert not marker.exists(), "unpickling the crafted .metadata ran its command"
