"""Job paths against the roots an agent allows (lazarus.core.jobpaths)."""

from __future__ import annotations

import os

from lazarus.core.jobpaths import outside


def test_paths_under_a_root_pass_and_others_are_named(tmp_path):
    root = tmp_path / "jobs"
    paths = {"checkpoint.dir": str(root / "a" / "ckpt"), "metrics": str(root / "m.jsonl")}
    assert outside(paths, [str(root)]) is None
    assert outside({"checkpoint.dir": str(root)}, [str(root)]) is None  # the root itself
    why = outside({**paths, "metrics": "/etc/cron.d/x"}, [str(root), str(tmp_path / "b")])
    assert why.startswith("metrics /etc/cron.d/x is outside the directories this node's agent "
                          f"lets jobs write to ({root}, {tmp_path / 'b'}")
    assert outside({"checkpoint.dir": None}, [str(root)]) is None   # unset: nothing written


def test_no_roots_means_no_limit_and_tricks_do_not_escape(tmp_path):
    assert outside({"metrics": "/anywhere"}, []) is None
    root = tmp_path / "jobs"
    root.mkdir()
    assert outside({"checkpoint.dir": str(root / ".." / "x")}, [str(root)])
    assert outside({"checkpoint.dir": str(tmp_path / "jobs-evil")}, [str(root)])  # a prefix
    os.symlink("/etc", root / "link")
    assert outside({"checkpoint.dir": str(root / "link" / "ck")}, [str(root)])


def test_a_corpus_dir_outside_the_roots_is_refused_only_when_it_would_be_built(tmp_path):
    import json

    import pytest

    from lazarus.core.errors import JobRefused
    from lazarus.core.trainconfig import TrainConfig
    from lazarus.trainer.corpus import MANIFEST
    from lazarus.trainer.train import train

    root, elsewhere = tmp_path / "jobs", tmp_path / "corpus"
    cfg = TrainConfig.from_dict({"steps": 1, "data": {"dir": str(elsewhere)}})
    with pytest.raises(JobRefused, match=f"data.dir {elsewhere} is outside the directories"):
        train(cfg, session=None, allowed_roots=[str(root)])
    # A corpus already there is only read: the check lets it through (and the run goes on
    # to need a process group, which this test has none of).
    elsewhere.mkdir()
    (elsewhere / MANIFEST).write_text(json.dumps({}))
    with pytest.raises(Exception) as info:
        train(cfg, session=None, allowed_roots=[str(root)])
    assert not isinstance(info.value, JobRefused)
