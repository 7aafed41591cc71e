"""The systemd units verify cleanly, rendered for this venv as README.md's "Deploy" section
installs them (the ExecStart paths must exist: systemd-analyze checks them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNITS = ("lazarus-daemon", "lazarus-agent")
# The venv path the units name; an installer swaps in its own.
SHIPPED_VENV = "/opt/lazarus/.venv"


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is missing: `apt-get install systemd` (deploy/setup-local.sh "
                    "does)")
    return found


def _render(dest: Path, source: Path = DEPLOY) -> list[Path]:
    venv = sys.prefix  # this test's venv has bin/lazarus, as an installed one would
    out = []
    for unit in UNITS:
        target = dest / f"{unit}.service"
        with open(target, "w") as f:
            subprocess.run(["sed", f"s|{SHIPPED_VENV}|{venv}|g", str(source / f"{unit}.service")],
                           stdout=f, check=True)
        out.append(target)
    return out


def _verify(units: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([_systemd_analyze(), "verify", *map(str, units)],
                          capture_output=True, text=True, timeout=60)


def test_units_verify_without_a_warning(tmp_path):
    units = _render(tmp_path)
    assert all(SHIPPED_VENV not in u.read_text() for u in units)
    proc = _verify(units)
    # Unknown keys and bad values are only warnings (exit 0): any output is a finding.
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stderr


def test_verify_catches_a_misspelt_key(tmp_path):
    """The check above is worth something: a typo in a unit does not pass silently."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for unit in UNITS:
        text = (DEPLOY / f"{unit}.service").read_text()
        (broken / f"{unit}.service").write_text(text.replace("Restart=always", "Restart=alway"))
    proc = _verify(_render(tmp_path, broken))
    assert "alway" in proc.stderr, proc.stderr


def test_agent_unit_leaves_the_ranks_to_the_agent_and_always_restarts():
    """Ranks are to outlive an agent restart: systemd signals the agent alone."""
    agent = (DEPLOY / "lazarus-agent.service").read_text().splitlines()
    daemon = (DEPLOY / "lazarus-daemon.service").read_text().splitlines()
    assert "KillMode=process" in agent
    assert "Restart=always" in agent and "Restart=always" in daemon
    assert "StartLimitIntervalSec=0" in agent and "StartLimitIntervalSec=0" in daemon


def test_env_file_sets_every_variable_the_units_use():
    env = {line.split("=", 1)[0] for line in (DEPLOY / "lazarus.env").read_text().splitlines()
           if line and not line.startswith("#")}
    used = set()
    for unit in UNITS:
        text = (DEPLOY / f"{unit}.service").read_text()
        used |= {part.split("}", 1)[0] for part in text.split("${")[1:]}
    assert used <= env, used - env
