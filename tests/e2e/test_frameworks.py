"""Real frameworks nobody here wrote, in the user's own environment (docs/adopting.md, "Your
environment"): PyTorch Lightning and HF Accelerate installed in a venv of their own -- not
Lazarus's -- launched as their users launch them, `-- VENV/bin/python train.py` and `-- bash
train.sh` (a wrapper that activates the venv), each through a fault once its first checkpoint
is down: Lightning a worker kill, whose survivor waits in a collective under Lightning's own
timeout; Accelerate's wrapper a node loss, whose survivor must be told from the lost node by
its output (one fault each, for the suite's time: tests/e2e/test_own_script.py puts HF's
Trainer through three kinds). Each recovery names the struck node, never its healthy peer,
every new round resumes from the framework's own newest checkpoint, and a run far longer
than its rendezvous timeout is never restarted for it (an exec'd rank's joining is seen;
tests/bench/bench_long_exec.py runs one for 5 minutes). The venv is built once
(tests.e2e.helpers.framework_venv)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import framework_venv

SCRIPTS = Path(__file__).parent / "scripts"
# Rounds' ranks must join within this (a new interpreter importing torch and a framework on
# a busy 2-core machine: up to ~15 s): a rank whose joining went unseen would restart its
# round and show as a round too many. The recoveries' `recovered` events are the other sign
# that joining is seen: a level-0 round counts as back only once every rank joined.
RDZV_TIMEOUT_S = "30"


@pytest.fixture(scope="module")
def venv() -> Path:
    """A user's venv with the frameworks; Lightning is in no environment of Lazarus's."""
    ours = subprocess.run([sys.executable, "-c", "import lightning"], capture_output=True)
    assert ours.returncode != 0, "Lightning is in Lazarus's venv: the test would prove nothing"
    return framework_venv()


def _up(tmp_path: Path, fault: str, saved: str, *command: str) -> tuple[dict, list[dict]]:
    """`lazarus up` of `command`, and `fault` struck at node n1 once the framework's first
    checkpoint is down (a file matching `saved` in the checkpoint dir, then one more): (the
    summary, the run's events). Not `--chaos FAULT@Ns`: a script nobody sees into is counted
    as running from its ranks' joining, and a framework's own setup after that (Accelerate's
    prepare(): 0.3-9 s on a loaded 2-core machine) struck a fault before its first save."""
    summary, workdir, ckpt = tmp_path / "summary.json", tmp_path / "up", tmp_path / "ckpt"
    with open(tmp_path / "up.out", "w+") as out, open(tmp_path / "up.err", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "up", "--workdir", str(workdir),
             "--nodes", "2", "--min-nodes", "2", "--summary", str(summary),
             "--rdzv-timeout", RDZV_TIMEOUT_S, "--chaos", "none", "--quiet", "--timeout", "500",
             "--", *command],
            stdout=out, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 400
            while len(list(ckpt.glob(saved))) < 2 and proc.poll() is None:
                assert time.monotonic() < deadline, "no checkpoint of the framework's in 400 s"
                time.sleep(0.2)
            assert proc.poll() is None, "the run ended before its fault"
            chaos = subprocess.run([sys.executable, "-m", "lazarus.cli", "chaos", fault,
                                    "--node", "n1", "--workdir", str(workdir)],
                                   capture_output=True, text=True, timeout=60)
            assert chaos.returncode == 0, chaos.stdout + chaos.stderr
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "steps and loss unknown: the script reports none" in stdout, stdout
    assert "(dp " not in stdout and "from scratch" not in stdout, stdout
    events = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines()]
    return json.loads(summary.read_text()), events


def _rank_logs(workdir: Path) -> dict[tuple[str, int, int], str]:
    """(node, round, rank) -> what that rank printed."""
    return {(p.parent.parent.name, int(p.parent.name[6:]), int(p.stem[5:])):
            p.read_text(errors="replace")
            for p in workdir.glob("nodes/logs/*/round-*/rank-*.log")}


DETECTED_AS = {"kill-worker": "worker_crash", "kill-node": "node_lost"}


def _check_recovery(result: dict, events: list[dict], venv: Path, logs: dict, *, fault: str,
                    steps: int) -> None:
    assert result["final_state"] == "SUCCEEDED"
    seen = [(e["kind"], e["fields"].get("kind"), e["fields"].get("culprit")) for e in events
            if e["kind"] in ("fault_detected", "recovered")]
    # the struck node named, never its healthy peer; back once every rank joined again
    assert seen == [("fault_detected", DETECTED_AS[fault], "n1"),
                    ("recovered", DETECTED_AS[fault], "n1")], seen
    # two rounds: the first and the fault's; none restarted for a "missing" join
    rounds = sorted({r for _, r, _ in logs})
    assert len(rounds) == 2, sorted(logs)
    started = {}
    for (node, round_, rank), text in logs.items():
        m = re.search(r"started at step (\d+)", text)
        if m is None:  # a rank of a round the next fault ended while it started
            assert round_ != rounds[-1], (node, round_, text[-800:])
            continue
        assert f"environment: {venv}" in text, (node, round_, text[-800:])
        started.setdefault(round_, set()).add(int(m[1]))
    # every rank of a round starts where the others do, from the framework's own checkpoint,
    # never an older one than the round before
    assert all(len(s) == 1 for s in started.values()), started
    assert rounds[0] in started and rounds[-1] in started, started
    in_order = [started[r].pop() for r in sorted(started)]
    assert in_order[0] == 0 and in_order[-1] > 0, in_order
    assert in_order == sorted(in_order), in_order
    last = [text for (_, r, _), text in logs.items() if r == rounds[-1]]
    assert all(f"done at step {steps}" in text for text in last), [t[-500:] for t in last]


def test_lightning_in_its_own_venv_by_its_python(tmp_path, venv):
    """`-- VENV/bin/python train.py`: the ranks run in that interpreter (a venv's python is a
    symlink to the same base interpreter as Lazarus's), Lightning's 30-minute collective
    timeout, which it passes to torch explicitly, gives way to Lazarus's backstop."""
    steps = 300
    result, events = _up(tmp_path, "kill-worker", "*step=*.ckpt", str(venv / "bin" / "python"),
                         str(SCRIPTS / "lightning_train.py"), "--ckpt-dir", str(tmp_path / "ckpt"),
                         "--max-steps", str(steps), "--step-time", "0.02")
    logs = _rank_logs(tmp_path / "up")
    _check_recovery(result, events, venv, logs, fault="kill-worker", steps=steps)
    first = min(round_ for _, round_, _ in logs)
    for (node, round_, rank), text in logs.items():
        assert "collective timeout: 0:10:00" in text, (node, round_, text[-800:])
        # Lightning says so on rank 0 only
        if rank == 0 and round_ > first:
            assert "Restoring states from the checkpoint" in text, (node, round_, text[-800:])


def test_accelerate_in_its_own_venv_through_a_wrapper(tmp_path, venv):
    """`-- bash train.sh VENV train.py`: a shell wrapper that activates the venv and runs
    python. The wrapper's python is watched from beside it: its joining seen, its lost peer
    (the node loss) told from its own crash by its output, so the lost node is named."""
    steps = 300
    result, events = _up(tmp_path, "kill-node", "step-*/COMPLETE", "bash",
                         str(SCRIPTS / "train.sh"), str(venv), str(SCRIPTS / "accelerate_train.py"),
                         "--ckpt-dir", str(tmp_path / "ckpt"), "--max-steps", str(steps),
                         "--step-time", "0.02")
    logs = _rank_logs(tmp_path / "up")
    _check_recovery(result, events, venv, logs, fault="kill-node", steps=steps)
    for key, text in logs.items():
        assert f"wrapper: {venv}/bin/python" in text, (key, text[-800:])
        if "started at step" in text:
            assert f"accelerate from: {venv}/lib/" in text, (key, text[-800:])
    # no rank of a stopped round is left training: the wrapper's python went with it
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "ckpt")], capture_output=True,
                          text=True)
    assert left.stdout.strip() == "", left.stdout
    assert os.path.isfile(tmp_path / "ckpt" / f"step-{steps}" / "COMPLETE")
