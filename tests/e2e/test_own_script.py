"""A training script of the user's own, unmodified, under Lazarus (docs/adopting.md): HF
transformers' Trainer run by `lazarus up -- ...` through a worker kill, a frozen rank and a
node loss; a DDP script in the shape of torch's own example run by `lazarus run -- ...`
against a running cluster, with what a user gets wrong (a program that is not there, a script
that exits at its start, a script that never joins its process group); the same DDP script
with the level-1 lines, recovered from memory with the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazarus.core.etcd_rbac import DAEMON_USER
from lazarus.core.records import ROLE_ACTIVE
from lazarus.sim.localcluster import LocalCluster

SCRIPT = Path(__file__).parent / "scripts" / "ddp_snapshot.py"
HF_SCRIPT = Path(__file__).parent / "scripts" / "hf_trainer.py"


def _lazarus(*args: str, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lazarus.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def _rank_logs(workdir: Path) -> dict[tuple[str, int, int], str]:
    """(node, round, rank) -> what that rank printed."""
    out = {}
    for p in workdir.glob("nodes/logs/*/round-*/rank-*.log"):
        out[(p.parent.parent.name, int(p.parent.name[6:]), int(p.stem[5:]))] = p.read_text(
            errors="replace")
    return out


def test_lazarus_up_recovers_an_unmodified_hf_trainer_script(tmp_path):
    """HF transformers' Trainer, as its users write it: a worker SIGKILLed, a rank SIGSTOPped
    (frozen: its peer waits in a collective), a node lost. Each is recovered with the struck
    node named, never its healthy peer, and every new round's ranks resume from the Trainer's
    own newest checkpoint, never from step 0."""
    summary = tmp_path / "summary.json"
    out = tmp_path / "out"
    proc = _lazarus("up", "--workdir", str(tmp_path / "up"), "--summary", str(summary),
                    # seconds with every rank joined, each once the round that answered
                    # the one before runs
                    "--chaos", "kill-worker@2s,stop-worker@3s,kill-node@4s",
                    "--first-step-timeout", "8", "--quiet", "--timeout", "400",
                    "--", "python", str(HF_SCRIPT), "--output-dir", str(out),
                    "--max-steps", "100", "--save-steps", "10", "--step-time", "0.05",
                    timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["final_state"] == "SUCCEEDED"
    got = {r["kind"]: r for r in result["recoveries"]}
    assert set(got) == {"kill-worker", "stop-worker", "kill-node"}, result["recoveries"]
    for kind, r in got.items():
        node = r["target"].split()[0]
        assert r["culprit"] == node, (kind, r)
        assert r["recovered_after_s"] is not None, (kind, r)
    assert got["kill-worker"]["detected_as"] == "worker_crash"
    assert got["stop-worker"]["detected_as"] == "hang"
    assert got["kill-node"]["detected_as"] == "node_lost"

    logs = _rank_logs(tmp_path / "up")
    rounds = sorted({r for _, r, _ in logs})
    assert len(rounds) == 4, sorted(logs)
    resumed = {}
    for (node, round_, rank), text in logs.items():
        m = re.search(r"resume from: (\S+)", text)
        assert m is not None, text[-500:]
        if round_ == rounds[0]:
            assert m[1] == "None"
        else:
            step = int(m[1].rpartition("checkpoint-")[2])
            assert step > 0, (node, round_, rank, text[-500:])
            resumed[round_] = step
    in_order = [resumed[r] for r in sorted(resumed)]
    assert in_order == sorted(in_order)  # never back to an earlier checkpoint
    assert (out / "checkpoint-100").is_dir()  # the Trainer's own last save: it ran to the end


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run-cluster")
    with LocalCluster(workdir / "cluster", lease_ttl_s=3) as c:
        c.allowed_roots = [workdir]
        c.start_etcd()
        c.start_daemon()
        for i in range(2):
            c.start_agent(f"n{i}", nproc=1, role=ROLE_ACTIVE)
        c.workdir_for_tests = workdir
        yield c


def _run(cluster: LocalCluster, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return _lazarus("run", *cluster.etcd_args(DAEMON_USER), *args, timeout=timeout,
                    cwd=cluster.workdir_for_tests)


def _status_text(cluster: LocalCluster) -> str:
    """`lazarus status`; "" while the daemon's API is not up yet (it starts with the run)."""
    proc = _lazarus("status", "--address", cluster.api_addresses[0], "--token-file",
                    str(cluster.token_file), timeout=60)
    assert proc.returncode in (0, 3), proc.stderr  # 3: no daemon answers (yet)
    return proc.stdout


def test_lazarus_run_follows_the_script_and_exits_with_its_outcome(cluster):
    """...and while it runs, `lazarus status` says what is known of a script that reports
    no steps (issue 42): its collectives, not step 0 with a zero loss."""
    snapshot = cluster.workdir_for_tests / "run-snap.pt"
    run = subprocess.Popen(
        [sys.executable, "-m", "lazarus.cli", "run", *cluster.etcd_args(DAEMON_USER),
         "--nodes", "2", "--nproc-per-node", "1", "--min-nodes", "1", "--", "python",
         str(SCRIPT), "--snapshot", str(snapshot), "--epochs", "8", "--pause", "0.3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=cluster.workdir_for_tests)
    shown = None
    try:
        while shown is None and run.poll() is None:
            out = _status_text(cluster)
            issued = re.search(r"step +unknown \(the script does not report steps\)  round "
                               r"\d+  \d+/2 ranks joined  ([\d,]+) collectives", out)
            if issued and int(issued[1].replace(",", "")) > 0:
                shown = out
            time.sleep(1.0)  # each look is a CLI process: on a busy machine, CPU the run needs
        stdout, stderr = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stdout + stderr
    assert shown is not None, "the run ended before its status showed its collectives"
    assert "loss 0.0000" not in shown and "tok/s" not in shown, shown
    assert "2 node(s) x 1 rank(s), min 1: python" in stdout
    assert "[round_started] round" in stdout and "SUCCEEDED" in stdout
    assert "the script resumes from its own checkpoints" in stdout and \
        "from scratch" not in stdout, stdout
    assert snapshot.exists()


def test_a_program_that_is_not_there_is_one_line(cluster):
    proc = _run(cluster, "--", "no-such-trainer", "--lr", "1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == ("lazarus run: error: [job] command: 'no-such-trainer' is "
                                   "not on PATH here, nor a file")
    # The agents check it too, on their machines: the run fails at once with their line.
    proc = _run(cluster, "--no-local-check", "--", "no-such-trainer")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout and "'no-such-trainer' is not on PATH" in proc.stdout


def test_a_script_that_exits_at_its_start_fails_the_run_with_its_words(cluster):
    code = "import sys; print('config error: --lr must be positive', file=sys.stderr); sys.exit(1)"
    proc = _run(cluster, "--nodes", "2", "--", "python", "-c", code)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[failed] every one of the last 3 rounds crashed before it ran (exit 1)" in out, out
    assert "config error: --lr must be positive" in out
    assert out.count("[round_started]") == 3  # not max_restarts (20) silent restarts


def test_an_interpreter_without_torch_fails_the_run_at_once_with_its_line(cluster, tmp_path):
    """The job's own Python (docs/adopting.md, "Your environment") that cannot run a rank:
    said once, by the agents, not three crashed rounds later."""
    import venv

    venv.create(tmp_path / "bare", with_pip=False)
    python = tmp_path / "bare" / "bin" / "python"
    proc = _run(cluster, "--nodes", "2", "--", str(python), "-c", "print('hi')")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{python} cannot import torch" in proc.stdout, proc.stdout
    assert proc.stdout.count("[round_started]") == 1, proc.stdout


def test_a_script_that_never_joins_its_process_group_is_named(cluster):
    proc = _run(cluster, "--nodes", "2", "--rdzv-timeout", "8", "--max-restarts", "0", "--",
                "python", "-c", "import time; time.sleep(600)")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "did not start within 8 s" in proc.stdout, proc.stdout


def _epoch_losses(text: str) -> dict[tuple[int, int], str]:
    """(rank, epoch) -> the loss that rank printed for it."""
    return {(int(m[1]), int(m[2])): m[3]
            for m in re.finditer(r"\[rank (\d+)\] .* epoch (\d+) loss (\S+)", text)}


def test_the_same_script_with_the_level_1_lines_recovers_from_memory(tmp_path):
    """The script's lines of `lazarus.trainer` (a report and a snapshot per epoch, a restore
    at start): a worker kill and a node loss are recovered from the copies in memory (the lost
    node's from its peer), and every epoch's loss is the uninterrupted run's, to the digit."""
    epochs = 30
    # the uninterrupted run, by torchrun: each rank's output in a file of its own (two ranks
    # on one stdout may interleave within a line)
    ref = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--log-dir", str(tmp_path / "ref"), "--redirects", "3",
         str(SCRIPT), "--snapshot", str(tmp_path / "ref.pt"), "--epochs", str(epochs),
         "--pause", "0"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    outputs = "\n".join(p.read_text() for p in (tmp_path / "ref").rglob("stdout.log"))
    reference = _epoch_losses(outputs)
    # torch's abort at exit (docs/constraints.md) after the last epoch is not the script's
    assert ref.returncode == 0 or len(reference) == 2 * epochs, ref.stderr[-2000:]
    assert sorted(reference) == [(r, e) for r in (0, 1) for e in range(epochs)]

    summary = tmp_path / "summary.json"
    proc = _lazarus("up", "--nodes", "2", "--nproc-per-node", "1", "--workdir",
                    str(tmp_path / "up"), "--summary", str(summary),
                    "--chaos", "kill-worker@4s,kill-node@5s", "--quiet", "--timeout", "400",
                    "--", "python", str(SCRIPT), "--snapshot", str(tmp_path / "snap.pt"),
                    "--epochs", str(epochs), "--pause", "0.3", "--lazarus", timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lazarus up: 2 node(s) + 1 spare(s) x 1 rank(s)" in proc.stdout
    result = json.loads(summary.read_text())
    recoveries = result["recoveries"]
    assert [(r["kind"], r.get("restored_from_tier")) for r in recoveries] == [
        ("kill-worker", 0), ("kill-node", 0)], recoveries
    # lazarus.trainer.run(main): n0's rank lost its peer both times and went on in place
    assert [r.get("in_place_ranks") for r in recoveries] == [1, 1], recoveries
    assert [r.get("anew") for r in recoveries] == [{"failed first": 1},
                                                   {"new on this node": 1}], recoveries
    # rank 0's step reports are the run's story: steps in the summary, the report's page
    assert result["steps_completed"] == epochs
    assert all(r.get("resumed_at_step") for r in recoveries), recoveries
    assert "loss" in (tmp_path / "up" / "report.html").read_text()
    logs = _rank_logs(tmp_path / "up")
    rounds = sorted({r for _, r, _ in logs})
    for (node, round_, rank), text in logs.items():
        if round_ > rounds[0]:
            assert "resuming training from memory at epoch" in text, (node, round_, text[-500:])
        # torchrun's environment: the restart count is the run's recoveries before the round
        assert f"restart {rounds.index(round_)} epoch" in text, (round_, text[-300:])
        for key, loss in _epoch_losses(text).items():
            assert loss == reference[key], (node, round_, key)
    assert f"epoch {epochs - 1} loss" in logs[max(k for k in logs if k[2] == 0)]
