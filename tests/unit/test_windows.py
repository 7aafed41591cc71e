"""Data windows left out, the lr-scale span, and how bad settings are named."""

from __future__ import annotations


import pytest
import torch

from lazarus.core.errors import UserError
from lazarus.core.trainconfig import OptimizerConfig, TrainConfig
from lazarus.trainer.launch import job_from_args
from lazarus.trainer.train import lr_scale_span
from lazarus.trainer.windows import DataWindows, window_of_step

from tests.unit.small_corpus import BATCH, SEQ, dataset, loader  # noqa: F401 (fixture)


def test_window_of_a_step_counts_from_the_start_and_crosses_epochs(dataset):
    assert window_of_step(loader(dataset), 1) == (0, 7)
    assert window_of_step(loader(dataset), 3) == (16, 23)
    # An epoch holds 12 whole steps; the 4-sequence tail is never read.
    assert window_of_step(loader(dataset), 13) == (100, 107)


def test_skipped_windows_are_passed_over_without_using_a_step(dataset):
    plain, skipping = loader(dataset), loader(dataset)
    windows = DataWindows(skipping, skip=[[8, 15], [20, 30]])
    # Step 1 reads [0, 7]; [8, 15] and [16, 23] (overlaps [20, 30]) and [24, 31] are left out.
    window, left_out = windows.next_window()
    assert (window["first"], left_out) == (0, [])
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(skipping.next_step(), plain.next_step()))
    window, left_out = windows.next_window()
    assert window["first"] == 32
    assert [(w["first"], w["last"]) for w in left_out] == [(8, 15), (16, 23), (24, 31)]
    plain.skip(3)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(skipping.next_step(), plain.next_step()))


def test_lr_scale_span_starts_at_the_restore_step_and_survives_a_restart():
    cfg = OptimizerConfig(lr_scale=0.5, lr_scale_steps=10)
    assert lr_scale_span(cfg, 0, {}) == (1, 10)
    assert lr_scale_span(cfg, 40, {"step": 40}) == (41, 50)  # a rollback with a new order
    # A checkpoint taken inside the span carries it: a restart continues, not restarts, it.
    assert lr_scale_span(cfg, 45, {"lr_scale": {"scale": 0.5, "first": 41, "last": 50}}) == (41, 50)
    other = OptimizerConfig(lr_scale=0.25, lr_scale_steps=10)
    assert lr_scale_span(other, 45, {"lr_scale": {"scale": 0.5, "first": 41, "last": 50}}) == (46, 55)
    assert lr_scale_span(OptimizerConfig(), 45, {"lr_scale": {"scale": 0.5, "first": 41, "last": 50}}) is None


@pytest.mark.parametrize("settings, message", [
    ({"data": {"skip_windows": [[5, 2]]}},
     r"data.skip_windows\[0\] must be \[first, last\] with 0 <= first <= last"),
    ({"data": {"skip_windows": [[0, 7], [-1, 3]]}}, r"data.skip_windows\[1\] must be"),
    ({"data": {"skip_windows": [[1, 2, 3]]}}, r"data.skip_windows\[0\] must be"),
    ({"data": {"skip_windows": [[1.5, 2]]}}, "'data.skip_windows' must be list of list of int"),
    ({"data": {"skip_windows": [3, 4]}}, "'data.skip_windows' must be list of list of int"),
    ({"optimizer": {"lr_scale": 0}}, "optimizer.lr_scale must be positive, got 0"),
    ({"optimizer": {"lr_scale_steps": -1}}, "optimizer.lr_scale_steps must not be negative, got -1"),
])
def test_bad_window_settings_are_named(settings, message):
    with pytest.raises(UserError, match=message):
        TrainConfig.from_dict(settings)


def test_flags_and_job_file_agree(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[train.data]\nskip_windows = [[16, 23]]\n[train.optimizer]\nlr_scale = 0.5\n')
    from_file, _ = job_from_args(["--config", str(job)])
    from_flags, _ = job_from_args(["--skip-window", "16:23", "--lr-scale", "0.5"])
    assert from_file == from_flags
    assert (from_flags.data.skip_windows, from_flags.optimizer.lr_scale) == ([[16, 23]], 0.5)
    assert TrainConfig.from_dict(from_flags.to_dict()) == from_flags
    with pytest.raises(UserError, match="--skip-window '16-23' must be FIRST:LAST"):
        job_from_args(["--skip-window", "16-23"])
