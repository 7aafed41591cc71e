"""The public API's calls that read the round's assignment (docs/adopting.md, level 1): the
restore point and data windows the daemon ordered, and rank 0's step lines for the report."""

from __future__ import annotations

import json

from lazarus.core.contract import ASSIGNMENT_ENV, METRICS_ENV, WorkerAssignment
from lazarus.trainer import API_VERSION
from lazarus.trainer.session import Session


def _assignment(**kw) -> str:
    return WorkerAssignment(rank=0, world_size=2, local_rank=0, round=4, store_host="h",
                            store_port=1, train=kw.pop("train", {}), **kw).to_json()


def test_restore_point_and_skip_windows_come_from_the_round(monkeypatch):
    s = Session(socket_path=None, rank=0, round=4)
    assert s.restore_point() is None and s.skip_windows() == []  # no agent: nothing ordered
    monkeypatch.setenv(ASSIGNMENT_ENV, _assignment(
        restore="/ckpt/step-40", restore_step=40,
        train={"data": {"skip_windows": [[1200, 1263], [2048, 2111]]}}))
    assert s.restore_point() == (40, "/ckpt/step-40")
    assert s.skip_windows() == [(1200, 1263), (2048, 2111)]
    # a round that restores from memory: restore() has it, not the checkpoint
    monkeypatch.setenv(ASSIGNMENT_ENV, _assignment(restore=None, restore_step=42,
                                                   snapshot="/dev/shm/x/r00000-s42.t0"))
    assert s.restore_point() is None
    assert API_VERSION == 1


def test_rank_0_writes_its_steps_for_the_report(monkeypatch, tmp_path):
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(METRICS_ENV, str(path))
    for rank in (1, 0):
        s = Session(socket_path=None, rank=rank, round=3)
        s.report(step=7, loss=2.5, tokens=4096, step_time_s=0.25, skipped=False)
        s.report(step=8, loss=float("nan"), tokens=4096, step_time_s=0.25, skipped=True)
        s.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["round"], r["skipped"]) for r in rows] == [(7, 3, False), (8, 3, True)]
    assert rows[0]["tokens"] == 4096 and rows[1]["loss"] != rows[1]["loss"]  # NaN kept
    # Lazarus's own watch of a level-0 rank writes nothing
    Session(socket_path=None, rank=0, round=3, level=0).report(step=9, loss=1.0)
    assert len(path.read_text().splitlines()) == 2
