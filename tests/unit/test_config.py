"""The job's settings: from a dict or a TOML [train] table, every mistake named."""

import pytest

from lazarus.core.errors import UserError
from lazarus.trainer.config import TrainConfig, load_toml


def test_defaults_and_round_trip():
    cfg = TrainConfig.from_dict({"model": "tiny", "dp": 2, "tp": 2, "global_batch": 8, "lr": 1})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("settings, message", [
    ({"stepz": 3}, "unknown train setting 'stepz'"),
    ({"steps": "ten"}, "'steps' must be int"),
    ({"steps": True}, "'steps' must be int"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"lr": "fast"}, "'lr' must be float"),
    ({"model": "huge"}, "unknown model size 'huge'"),
    ({"schedule": "linear"}, "schedule must be one of cosine, wsd"),
    ({"min_lr": 1.0, "lr": 0.1}, "min_lr 1.0 is above lr 0.1"),
    ({"dp": 3, "global_batch": 8}, "global batch 8 is not divisible by dp=3"),
    ({"tp": 3}, "tp=3 does not divide the model's attention heads"),
    ({"tp": 4, "model": "tiny"}, "tp=4 does not divide the model's key/value heads"),
    ({"tp": 2, "seq_len": 33}, "sequence length"),
    ({"seq_len": 5000}, "seq_len 5000 exceeds model tiny's maximum 1024"),
    ({"resume": "latest"}, "needs ckpt_dir"),
    ({"micro_batch": 3, "global_batch": 8}, "micro batch 3 does not divide"),
])
def test_bad_values_name_the_setting(settings, message):
    with pytest.raises(UserError, match=message):
        TrainConfig.from_dict(settings)


def test_toml_job_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[train]\nmodel = "tiny"\nsteps = 7\nlr = 3e-3\nckpt_dir = "/tmp/x"\n')
    cfg = TrainConfig.from_dict(load_toml(job))
    assert (cfg.steps, cfg.lr, cfg.ckpt_dir) == (7, 3e-3, "/tmp/x")


def test_malformed_toml_names_file_and_line(tmp_path):
    job = tmp_path / "bad.toml"
    job.write_text('[train]\nmodel = "tiny"\nsteps = = 3\n')
    with pytest.raises(UserError, match=rf"{job}.*line 3"):
        load_toml(job)


def test_toml_without_train_table_or_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[other]\nx = 1\n')
    with pytest.raises(UserError, match="no \\[train\\] table"):
        load_toml(job)
    with pytest.raises(UserError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
