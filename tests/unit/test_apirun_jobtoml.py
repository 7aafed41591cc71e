"""A job of `lazarus run` reaches the daemon's SubmitJob as the text of a job file: what the
daemon parses back must be the job the user's flags made, to the byte of every argument,
variable and path, or the ranks would run something else."""

from __future__ import annotations

import argparse
import tomllib

import pytest

from lazarus.core import jobspec
from lazarus.ops import apirun
from lazarus.ops.run import build_job, job_options


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    job_options(p, nodes=1)
    return p.parse_args(argv)


AWKWARD = ['python', 'train.py', '--msg', 'say "hi"\\n', 'tab\there', 'ümlaut 🚀', "it's",
           '\x7f\x01', '[not] = a table', '#not a comment']


def test_a_run_job_with_awkward_arguments_comes_back_intact():
    args = _args(["--nodes", "3", "--min-nodes", "2", "--nproc-per-node", "4",
                  "--env", 'QUOTE="x"', "--env", "NL=a\nb", "--env", "EMPTY=",
                  "--cwd", "/tmp/with space", "--name", "näme", "--max-restarts", "0",
                  "--rdzv-timeout", "7.5", "--spares-ok"])
    job = build_job(args, AWKWARD, check=False)
    text = apirun.job_toml(job)
    back = jobspec.from_dict(tomllib.loads(text), source="job_toml")
    assert back == job
    assert back.command == AWKWARD and back.env["NL"] == "a\nb" and back.cwd == "/tmp/with space"


def test_a_builtin_job_with_train_and_policy_comes_back_intact():
    job = jobspec.from_dict(tomllib.loads(
        '[job]\nname = "b"\nnodes = 2\nmin_nodes = 1\n[policy]\nmax_spikes = 5\n'
        '[train]\nsteps = 50\n[train.model]\nname = "tiny"\n[train.data]\nglobal_batch = 4\n'
        '[train.optimizer]\nlr = 3e-4\n'), source="t")
    back = jobspec.from_dict(tomllib.loads(apirun.job_toml(job)), source="job_toml")
    assert back == job and back.train["optimizer"]["lr"] == 3e-4


@pytest.mark.parametrize("value", [3e-4, 0.1 + 0.2, 12345678901234567890.0])
def test_floats_are_toml(value):
    job = jobspec.from_dict({"job": {"name": "f"}, "train": {"optimizer": {"lr": value}}},
                            source="t")
    back = jobspec.from_dict(tomllib.loads(apirun.job_toml(job)), source="job_toml")
    assert back.train["optimizer"]["lr"] == value
