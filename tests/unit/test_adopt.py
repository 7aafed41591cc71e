"""The record of a node's running ranks (lazarus.agent.adopt): what one agent writes, the next
reads back whole, and a record nobody can read is ignored, not fatal."""

from __future__ import annotations

import os

from lazarus.agent.adopt import Left, LeftRank, read_note, record_path, start_time
from lazarus.trainer import exitnote


def _left() -> Left:
    return Left(node="n3", round=7, job_id="J", world_size=16, lease=0x1B81A2047CEB9F53,
                channel="/run/lazarus/n3.sock", checkpoint_dir="/ckpt", agent_pid=4242,
                ranks=[LeftRank(local_rank=lr, rank=8 + lr, pid=1000 + lr, started=1.7e9 + lr)
                       for lr in range(8)])


def test_a_record_reads_back_as_written_and_replaces_the_old_one(tmp_path):
    path = record_path(tmp_path, "n3")
    Left(node="n3", round=6, job_id="J", world_size=16, lease=1, channel="x",
         checkpoint_dir=None, agent_pid=1).save(path)
    _left().save(path)
    assert Left.load(path) == _left()
    assert [p.name for p in tmp_path.iterdir()] == ["n3.ranks.json"]  # no temporary left


def test_no_record_or_an_unreadable_one_adopts_nothing(tmp_path):
    path = record_path(tmp_path, "n3")
    assert Left.load(path) is None
    for garbage in ("", "{not json", '{"node": "n3"}', '{"ranks": [{"pid": "x"}]}', "[]"):
        path.write_text(garbage)
        assert Left.load(path) is None, garbage


def test_an_exit_note_counts_only_for_the_process_that_left_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZARUS_STACKS_DIR", str(tmp_path))
    exitnote.record(75)
    me, started = os.getpid(), start_time(os.getpid())
    assert read_note(tmp_path, me, started) == 75
    # an earlier process that had this pid
    assert read_note(tmp_path, me, started - 30) is None
    assert read_note(tmp_path, me + 1, started) is None


def test_a_record_keeps_the_launch_round_of_carried_ranks_and_old_ones_still_load(tmp_path):
    path = record_path(tmp_path, "n3")
    carried = Left(node="n3", round=9, rank_round=7, job_id="J", world_size=16, lease=1,
                   channel="x", checkpoint_dir=None, agent_pid=1)
    carried.save(path)
    assert Left.load(path) == carried and Left.load(path).rank_round == 7
    # written by an agent from before replica rounds: no rank_round, launched in `round`
    path.write_text('{"node": "n3", "round": 7, "job_id": "J", "world_size": 16, "lease": 1, '
                    '"channel": "x", "checkpoint_dir": null, "agent_pid": 1, "ranks": []}')
    assert Left.load(path).rank_round == 7
