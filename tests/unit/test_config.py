"""The job's settings: from a dict or a TOML [train] table in sections, every mistake named."""

import os
import subprocess
import sys

import pytest

from lazarus.core.errors import UserError
from lazarus.core.trainconfig import TrainConfig, load_toml


def test_defaults_and_round_trip():
    cfg = TrainConfig.from_dict({"model": {"name": "tiny"}, "parallelism": {"dp": 2, "tp": 2},
                                 "data": {"global_batch": 8}, "optimizer": {"lr": 1}})
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert (cfg.parallelism.dp, cfg.parallelism.tp, cfg.checkpoint.keep_last) == (2, 2, 3)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("settings, message", [
    ({"stepz": 3}, r"unknown train setting 'stepz' \(known: steps, seed, metrics, deterministic, peak_tflops, and the tables "
                   r"\[train.model\], \[train.parallelism\]"),
    ({"lr": 0.1}, r"unknown train setting 'lr': it belongs in \[train.optimizer\] \(optimizer.lr\)"),
    ({"optimizer": {"lrr": 0.1}}, r"unknown train setting 'optimizer.lrr' \(known in \[train.optimizer\]: lr, "),
    ({"optimizer": 0.1}, r"train setting 'optimizer' must be a table \(\[train.optimizer\]\)"),
    ({"model": "tiny"}, r"train setting 'model' must be a table"),
    ({"steps": "ten"}, "'steps' must be int"),
    ({"steps": True}, "'steps' must be int"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"optimizer": {"lr": "fast"}}, "'optimizer.lr' must be float, got 'fast'"),
    ({"parallelism": {"tp": 1.5}}, "'parallelism.tp' must be int"),
    ({"checkpoint": {"async_save": 1}}, "'checkpoint.async_save' must be bool"),
    ({"model": {"name": "huge"}}, "unknown model size 'huge'"),
    ({"optimizer": {"schedule": "linear"}}, "optimizer.schedule must be one of cosine, wsd"),
    ({"optimizer": {"min_lr": 1.0, "lr": 0.1}}, "optimizer.min_lr 1.0 is above optimizer.lr 0.1"),
    ({"optimizer": {"grad_clip": 0}}, "optimizer.grad_clip must be positive, got 0"),
    ({"parallelism": {"dp": 0}}, "parallelism.dp must be at least 1, got 0"),
    ({"parallelism": {"dp": 3}, "data": {"global_batch": 8}}, "global batch 8 is not divisible by dp=3"),
    ({"parallelism": {"tp": 3}}, "tp=3 does not divide the model's attention heads"),
    ({"parallelism": {"tp": 4}}, "tp=4 does not divide the model's key/value heads"),
    ({"parallelism": {"tp": 2}, "data": {"seq_len": 33}}, "sequence length"),
    ({"data": {"seq_len": 5000}}, "data.seq_len 5000 exceeds model tiny's maximum 1024"),
    ({"data": {"micro_batch": 3, "global_batch": 8}}, "micro batch 3 does not divide"),
    ({"checkpoint": {"resume": "latest"}}, "checkpoint.resume = 'latest' needs checkpoint.dir"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last must be at least 1, got 0"),
    ({"checkpoint": {"every": -1}}, "checkpoint.every must not be negative, got -1"),
])
def test_bad_values_name_the_setting(settings, message):
    with pytest.raises(UserError, match=message):
        TrainConfig.from_dict(settings)


def test_toml_job_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[train]\nsteps = 7\n[train.model]\nname = "tiny"\n[train.optimizer]\nlr = 3e-3\n'
                   '[train.checkpoint]\ndir = "/tmp/x"\n')
    cfg = TrainConfig.from_dict(load_toml(job))
    assert (cfg.steps, cfg.optimizer.lr, cfg.checkpoint.dir) == (7, 3e-3, "/tmp/x")


def test_malformed_toml_names_file_and_line(tmp_path):
    job = tmp_path / "bad.toml"
    job.write_text('[train]\nsteps = 3\nseed = = 3\n')
    with pytest.raises(UserError, match=rf"{job}.*line 3"):
        load_toml(job)


def test_toml_without_train_table_or_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[other]\nx = 1\n')
    with pytest.raises(UserError, match="no \\[train\\] table"):
        load_toml(job)
    with pytest.raises(UserError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


def test_checking_a_job_loads_no_torch():
    # The daemon validates submitted jobs in its pure decide(); that must stay cheap.
    code = ("import sys, lazarus.daemon.decide\n"
            "from lazarus.core.trainconfig import TrainConfig\n"
            "TrainConfig.from_dict({'parallelism': {'tp': 2}})\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_ranks_share_the_hosts_cores_unless_the_operator_said_otherwise():
    from lazarus.core.settings import rank_threads_env
    cpus = len(os.sched_getaffinity(0))
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert rank_threads_env(1, {}) == {"OMP_NUM_THREADS": str(cpus), **passive}
    assert rank_threads_env(cpus * 4, {}) == {"OMP_NUM_THREADS": "1", **passive}  # never 0
    assert rank_threads_env(8, {"OMP_NUM_THREADS": "6"}) == passive
    assert rank_threads_env(8, {"OMP_NUM_THREADS": "6", "OMP_WAIT_POLICY": "ACTIVE"}) == {}
