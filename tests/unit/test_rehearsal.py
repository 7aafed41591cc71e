"""What the zygote does with a rehearsal request it cannot use: one clear line in its log and
the word "failed" or "skipped" back, and it goes on serving (lazarus.trainer.zygote)."""

from __future__ import annotations

import json

import pytest
import torch  # noqa: F401 -- imported, as in the zygote: its import starts threads of its own

from lazarus.core.trainconfig import ModelSpec, ParallelConfig, TrainConfig
from lazarus.trainer import rehearsal
from lazarus.trainer import zygote
from lazarus.trainer.zygote import _rehearse


@pytest.mark.parametrize("body, error", [
    (b"not json", "JSONDecodeError"),
    (b'{"world_size": 2}', "KeyError: 'train'"),
    (b'{"train": [], "world_size": 2}', "train must be an object"),
    (b'{"train": {}, "world_size": "2"}', "world_size an integer"),
    (b'{"train": {"parallelism": {"dp": 0}}, "world_size": 2}', "parallelism.dp"),
])
def test_a_request_it_cannot_read_fails_with_one_line_saying_why(body, error, capsys,
                                                                 monkeypatch):
    # pytest's own threads may come and go; the zygote's check is of the zygote's
    monkeypatch.setattr(zygote, "_threads", lambda: 1)
    assert _rehearse(body) == "failed"
    (line,) = capsys.readouterr().out.splitlines()
    said = json.loads(line)
    assert said["event"] == "rehearsal" and said["result"] == "failed"
    assert error in said["error"], said


@pytest.mark.parametrize("cfg, world, device, why", [
    (TrainConfig(), 1, "cuda", "only CPU meshes"),
    (TrainConfig(parallelism=ParallelConfig(compile=True)), 1, "cpu", "torch.compile"),
    (TrainConfig(model=ModelSpec(fused_kernels=True)), 1, "cpu", "fused kernels"),
    (TrainConfig(parallelism=ParallelConfig(dp=2)), 4, "cpu", "is not 4 ranks"),
    (TrainConfig(parallelism=ParallelConfig(dp=2)), 2, "cpu", None),
])
def test_what_is_not_rehearsed_says_why(cfg, world, device, why):
    got = rehearsal.why_not(cfg, world, device)
    assert (got is None) if why is None else (why in got), got
    if why is not None:  # and the request is answered without running anything
        assert rehearsal.rehearse(cfg.to_dict(), world, device) == f"skipped: {got}"
