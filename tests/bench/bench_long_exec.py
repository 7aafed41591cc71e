"""A long run of a rank Lazarus does not run itself (on demand, a soak):
`pytest tests/bench/bench_long_exec.py -m bench -s`.

HF Accelerate from a venv of its own, through a shell wrapper (`-- bash train.sh VENV
accelerate_train.py`), with no fault, for 5+ minutes -- more than twice the round's 120 s
rendezvous timeout. A rank whose joining went unseen (nothing of Lazarus runs in a wrapper's
process; lazarus.trainer.progwatch watches it) was taken for one that never started and its
round restarted every 120 s; the run must be one round from start to end.

Measured on a 2-core machine (2026-11-29): 319.6 s, one round, SUCCEEDED.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import framework_venv

pytestmark = pytest.mark.bench

SCRIPTS = Path(__file__).parents[1] / "e2e" / "scripts"
STEPS = 5000  # 0.05 s of pause each, plus the step: past 5 minutes here


def test_a_wrapped_rank_runs_for_minutes_in_one_round(tmp_path):
    venv = framework_venv()
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "up", "--nodes", "2", "--min-nodes", "2",
         "--workdir", str(tmp_path / "up"), "--summary", str(summary), "--chaos", "none",
         "--quiet", "--timeout", "1200", "--", "bash", str(SCRIPTS / "train.sh"), str(venv),
         str(SCRIPTS / "accelerate_train.py"), "--ckpt-dir", str(tmp_path / "ckpt"),
         "--max-steps", str(STEPS), "--save-every", "500", "--step-time", "0.05"],
        capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["final_state"] == "SUCCEEDED"
    assert result["wall_time_s"] > 300, result["wall_time_s"]
    assert proc.stdout.count("[round_started]") == 1, proc.stdout
