"""`lazarus train` end to end: real launcher, real worker processes on gloo.

The core promise: a run killed after a checkpoint and resumed by fresh processes produces the
very same losses as a run that was never interrupted, and a checkpoint taken on one mesh
continues on another with the same global batch.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.core.stall import is_step
from lazarus.core.exitcodes import INJECTED_FAULT
from lazarus.sim.trainer_faults import worker_env
from lazarus.trainer.launch import job_from_args
from tests.forkedcli import run_cli_forked

N = 3  # steps before the crash; the runs go to 2N
COMMON = ["--model", "tiny", "--steps", str(2 * N), "--global-batch", "8", "--micro-batch", "2",
          "--seq-len", "32", "--lr", "3e-3", "--warmup-steps", "2", "--seed", "5"]


def lazarus_train(args: list[str], *, faults: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`faults`: what the ranks inject (lazarus.sim.trainer_faults), e.g. "crash@4:0"."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(worker_env(faults) if faults else {})}
    return subprocess.run([sys.executable, "-m", "lazarus.cli", "train", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def train_ok(args: list[str]) -> subprocess.CompletedProcess:
    # No retry for torch's abort at exit (docs/constraints.md): ranks end without torch's
    # teardown (trainer/exitnote.finish), so one would be a regression.
    result = lazarus_train(args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def losses(metrics: Path) -> dict[int, float]:
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if is_step(r)]
    assert all(set(r) == {"step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "time"}
               for r in rows)
    return {r["step"]: r["loss"] for r in rows}


# ---- bad input: one clear line, exit 2, nothing touched ----

BAD_INPUT = [
    (["--nproc", "3", "--dp", "2", "--tp", "2"], "mesh dp=2 x tp=2 = 4 ranks does not match --nproc 3"),
    (["--nproc", "4", "--dp", "4", "--global-batch", "10"], "global batch 10 is not divisible by dp=4"),
    (["--model", "huge"], "unknown model size 'huge'"),
    (["--resume", "{tmp}/nowhere"], "checkpoint {tmp}/nowhere does not exist"),
    (["--resume", "{tmp}/ckpt/step-00000004"], "is incomplete: no manifest.json"),
    (["--resume", "--ckpt-dir", "{tmp}/ckpt"], "no committed checkpoint in {tmp}/ckpt"),
    (["--config", "{tmp}/job.toml"], "job.toml is not valid TOML: .*line 3"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """(the files before, what each case of BAD_INPUT did, the files after, the dir): every
    case against the same metrics file, incomplete checkpoint and broken job file."""
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "metrics.jsonl").write_text('{"step": 1}\n')
    incomplete = tmp / "ckpt" / "step-00000004"
    incomplete.mkdir(parents=True)
    (incomplete / "__0_0.distcp").write_bytes(b"partial")
    (tmp / "job.toml").write_text('[train]\nmodel = "tiny"\nsteps = = 3\n')
    before = _files(tmp)
    done = run_cli_forked([["train", *[a.format(tmp=tmp) for a in args], "--metrics",
                            f"{tmp}/metrics.jsonl"] for args, _ in BAD_INPUT])
    return before, done, _files(tmp), tmp


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(refused, case):
    before, done, after, tmp = refused
    result, message = done[case], BAD_INPUT[case][1]
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("lazarus train: error: ")
    assert re.search(message.format(tmp=tmp), lines[0]), lines[0]
    assert after == before  # nothing written, nothing removed


def test_flags_override_the_job_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[train]\nsteps = 7\n[train.model]\nname = "tiny"\n[train.parallelism]\ntp = 2\n'
                   '[train.data]\nglobal_batch = 4\n')
    cfg, nproc = job_from_args(["--config", str(job), "--steps", "9", "--nproc", "4", "--lr", "0.01"])
    assert (cfg.steps, cfg.parallelism.tp, cfg.parallelism.dp, nproc) == (9, 2, 2, 4)
    assert (cfg.model.name, cfg.data.global_batch, cfg.optimizer.lr) == ("tiny", 4, 0.01)


# ---- exact resume and resharding ----

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted dp2 x tp2 run, and the same run killed at step N+1 and resumed."""
    tmp = tmp_path_factory.mktemp("runs")
    mesh = ["--nproc", "4", "--dp", "2", "--tp", "2"]
    straight = train_ok(COMMON + mesh + ["--metrics", str(tmp / "straight.jsonl")])

    ckpt = tmp / "ckpt"
    crashed = lazarus_train(COMMON + mesh + ["--metrics", str(tmp / "resumed.jsonl"), "--ckpt-dir", str(ckpt),
                                             "--ckpt-every", str(N)], faults=(f"crash@{N + 1}:0",))
    assert crashed.returncode == INJECTED_FAULT, crashed.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == [".lazarus-job", f"step-{N:08d}"]
    shutil.copytree(ckpt, tmp / "ckpt-at-N")  # pristine, for the reshard runs

    resumed = train_ok(COMMON + mesh + ["--metrics", str(tmp / "resumed.jsonl"), "--ckpt-dir", str(ckpt),
                                        "--resume"])
    return {"tmp": tmp, "straight": losses(tmp / "straight.jsonl"), "resumed": losses(tmp / "resumed.jsonl"),
            "stdout": straight.stdout, "resumed_stdout": resumed.stdout}


def test_loss_falls_and_progress_is_printed(runs):
    straight = runs["straight"]
    assert list(straight) == list(range(1, 2 * N + 1))
    assert straight[2 * N] < straight[1]
    assert f"step     {2 * N}/{2 * N} | loss " in runs["stdout"]


def test_resume_gives_bit_identical_losses(runs):
    straight, resumed = runs["straight"], runs["resumed"]
    assert "resumed from" in runs["resumed_stdout"]
    # Steps 1..N come from the run that crashed, N+1..2N from the fresh processes.
    assert list(resumed) == list(range(1, 2 * N + 1))
    for step in range(N + 1, 2 * N + 1):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 1), (4, 1)])
def test_reshard_continues_on_another_mesh(runs, dp, tp):
    tmp = runs["tmp"]
    ckpt = tmp / f"ckpt-dp{dp}tp{tp}"
    shutil.copytree(tmp / "ckpt-at-N", ckpt)
    metrics = tmp / f"dp{dp}tp{tp}.jsonl"
    train_ok(COMMON + ["--nproc", str(dp * tp), "--dp", str(dp), "--tp", str(tp), "--metrics", str(metrics),
                       "--ckpt-dir", str(ckpt), "--resume"])
    resharded, straight = losses(metrics), runs["straight"]
    assert list(resharded) == list(range(N + 1, 2 * N + 1))
    for step in resharded:
        # Same weights, optimizer state and data; only the order of float reductions differs.
        assert abs(resharded[step] - straight[step]) < 2e-3, (step, resharded[step], straight[step])


def test_compile_and_fused_kernels_train_the_steps_eager_trains(tmp_path):
    """`--compile` (each block through torch.compile) and `--fused-kernels
    --activation-checkpointing` (the Triton kernels -- on CPU under the triton interpreter --
    and each block's activations recomputed in backward) are other ways to the same steps: the
    losses are the eager run's to fp32 rounding, and so are all three at once (under the
    interpreter torch.compile calls the kernels eagerly: it failed tracing into it). The three
    runs go at once (compiling is most of the time)."""
    tiny = ["--nproc", "1", "--model", "tiny", "--steps", "3", "--global-batch", "2",
            "--seq-len", "16"]
    variants = {"eager": [], "compile": ["--compile"],
                "fused": ["--fused-kernels", "--activation-checkpointing", "--compile"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "train", *tiny, *flags, "--metrics",
         str(tmp_path / f"{name}.jsonl")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**env, "TRITON_INTERPRET": "1"} if name == "fused" else env)
        for name, flags in variants.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-3000:])
        assert "step     3/3 | loss " in out, (name, out)
    eager = losses(tmp_path / "eager.jsonl")
    assert list(eager) == [1, 2, 3]
    for name in ("compile", "fused"):
        got = losses(tmp_path / f"{name}.jsonl")
        assert got == pytest.approx(eager, rel=1e-5), (name, got, eager)
