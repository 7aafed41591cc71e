"""`lazarus COMMAND --help` opens with a description that is whole: a module docstring's first
line, taken as the description, once cut `lazarus etcd`'s mid-parenthesis and `lazarus
agent`'s mid-list. Read for every command in one process (torch is imported once)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lazarus.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import contextlib, io, json, os
os.environ["COLUMNS"] = "10000"  # no wrapping: the description is one line
from lazarus import cli

out = {}
for name in cli.COMMANDS:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            cli.main([name, "--help"])
        except SystemExit:
            pass
    out[name] = buf.getvalue().split("\n\n")[1]  # usage, description, arguments ...
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def descriptions() -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_description_is_not_cut_short(descriptions, name):
    text = descriptions[name].strip()
    assert text and not text.startswith(("options:", "positional arguments:")), text
    assert text.count("(") == text.count(")") and text.count('"') % 2 == 0, text
    assert not text.endswith((",", ";", ":", "-", "(")), text


@pytest.mark.parametrize("name", ["etcd", "agent"])
def test_etcd_and_agent_say_a_whole_sentence(descriptions, name):
    text = descriptions[name].strip()
    assert text.startswith(f"`lazarus {name}`: ") and text.endswith("."), text
