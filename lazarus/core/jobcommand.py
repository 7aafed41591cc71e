"""What each rank of a job runs: `[job] command` (docs/adopting.md).

A job names a command, as torchrun is given one; the built-in trainer is the default command,
not a special case (`BUILTIN`). Every rank is started the same way: a parked worker (Python and
torch already imported, lazarus.agent.workers) takes the round's assignment, sets torchrun's
environment and runs the command (lazarus.trainer.rankrun) one of three ways (`how_run`):
  - WARM: `python ...` (the agent's own interpreter) inside itself: no process start, no
    `import torch`;
  - OWN_PYTHON: another interpreter by its path (a venv's, a conda env's, a container's) is
    exec'd with the rank side of Lazarus on its path (lazarus.trainer.rankboot): the script
    runs in its own environment, watched as a warm one is;
  - PROGRAM: anything else (a shell wrapper) replaces the worker by exec, with a watcher
    process beside it that says when it joined its round (lazarus.trainer.progwatch).

Checked when the job is submitted, and again by each agent before it starts a rank: an agent
that cannot run it says why in one line, and the run fails with that line.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from lazarus.core.errors import UserError

# The built-in trainer (lazarus.trainer.worker), which reads its assignment from the
# environment like any command reads torchrun's.
BUILTIN: tuple[str, ...] = ("python", "-m", "lazarus.trainer.worker")
# Programs that name "the Python the agent runs": such a command runs in the parked worker.
_PYTHONS = ("python", "python3", f"python3.{sys.version_info.minor}")
# Bounds of what a job record carries to every agent.
MAX_ARGS = 256
MAX_TEXT = 4096
# ... and in all: the command and env are copied into every round record, one etcd value
# (etcd refuses requests past 1.5 MiB by default).
MAX_TOTAL = 64 << 10


def is_builtin(command: list[str] | tuple[str, ...]) -> bool:
    return tuple(command) == BUILTIN


WARM, OWN_PYTHON, PROGRAM = "warm", "own python", "program"
# What names a Python interpreter: python, python3, python3.12 (a path's last part)
_PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?")


def how_run(command: list[str] | tuple[str, ...]) -> str:
    """WARM, OWN_PYTHON or PROGRAM (see the module's docstring)."""
    prog = command[0]
    if prog in _PYTHONS:
        return WARM
    if not _PYTHON_NAME.fullmatch(os.path.basename(prog)):
        return PROGRAM
    if "/" not in prog:  # python3.X of another minor version, on PATH
        return OWN_PYTHON
    return WARM if same_environment(prog, sys.executable) else OWN_PYTHON


def runs_warm(command: list[str] | tuple[str, ...]) -> bool:
    """Whether `command` runs inside the agent's own Python (a parked worker), not by exec:
    `python ...` or the agent's interpreter by its path."""
    return how_run(command) == WARM


def venv_of(python: str) -> str | None:
    """The virtual environment whose interpreter `python` is (the directory holding its
    pyvenv.cfg), or None for a base interpreter (a system's, a conda env's, a container's)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    return os.path.realpath(root) if os.path.isfile(os.path.join(root, "pyvenv.cfg")) else None


def same_environment(a: str, b: str) -> bool:
    """Whether interpreters `a` and `b` see the same packages: the same binary, and the same
    venv or none. A venv's python is a symlink to its base interpreter, so the binary alone
    does not tell a user's venv from ours."""
    return os.path.realpath(a) == os.path.realpath(b) and venv_of(a) == venv_of(b)


def parse(job: Mapping, source: str) -> tuple[list[str], dict[str, str], str | None]:
    """[job] command, env and cwd, checked for shape (not yet for the program's presence)."""
    command = job.get("command", list(BUILTIN))
    if (not isinstance(command, list) or not command or len(command) > MAX_ARGS
            or not all(isinstance(a, str) and len(a) <= MAX_TEXT for a in command)
            or not command[0]):
        raise UserError(f"{source}: [job] command must be a non-empty list of strings, e.g. "
                        f'["python", "train.py", "--config", "x.toml"], got {command!r:.200}')
    env = job.get("env", {})
    if not isinstance(env, dict) or len(env) > MAX_ARGS or not all(
            isinstance(k, str) and k and "=" not in k and isinstance(v, str)
            and len(v) <= MAX_TEXT for k, v in env.items()):
        raise UserError(f"{source}: [job] env must be a table of NAME = \"value\" strings, "
                        f"got {env!r:.200}")
    total = sum(map(len, command)) + sum(len(k) + len(v) for k, v in env.items())
    if total > MAX_TOTAL:
        raise UserError(f"{source}: [job] command and env hold {total} characters; at most "
                        f"{MAX_TOTAL} (they go into every round record)")
    cwd = job.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
        raise UserError(f"{source}: [job] cwd must be an absolute path, got {cwd!r:.200}")
    return list(command), dict(env), cwd


def check_runnable(command: list[str], *, cwd: str | None, path: str | None = None) -> None:
    """UserError unless this machine can start `command` (in `cwd`): its program on PATH or
    a file, executable (or, for a Python command, its script a readable file). Relative
    paths are taken from `cwd`, else from where this runs."""
    base = Path(cwd) if cwd else Path.cwd()
    if cwd is not None and not base.is_dir():
        raise UserError(f"[job] cwd {cwd!r} is not a directory here")
    kind = how_run(command)
    if kind != PROGRAM:
        script = _python_script(command)
        if script is not None:
            p = base / script
            if not p.is_file() or not os.access(p, os.R_OK):
                raise UserError(f"[job] command: {script!r} is not a readable file"
                                + (f" in {cwd}" if cwd else f" (relative to {base})"))
    if kind == WARM:
        return
    prog = command[0]
    if "/" in prog:
        p = base / prog
        if not p.is_file() or not os.access(p, os.X_OK):
            raise UserError(f"[job] command: {prog!r} is not an executable file")
        return
    if shutil.which(prog, path=path) is None:
        raise UserError(f"[job] command: {prog!r} is not on PATH here, nor a file")


def _python_script(command: list[str]) -> str | None:
    """The script of `python [OPTIONS] SCRIPT ...`; None for -m / -c / none."""
    try:
        kind, target, _ = split_python(command)
    except UserError:
        return None
    return target if kind == "script" else None


def split_python(command: list[str]) -> tuple[str, str, list[str]]:
    """(kind, target, argv) of a Python command: kind "module" (-m MOD), "code" (-c CODE) or
    "script" (a path); argv is what sys.argv becomes. Interpreter options other than these
    (-u, -O, -W ...) are `python_options`: a warm command drops them (the parked interpreter
    is already running), an OWN_PYTHON one passes them to its interpreter."""
    return _parse_python(command)[1:]


def python_options(command: list[str]) -> list[str]:
    """The interpreter options of a Python command, before its script, -m or -c."""
    return _parse_python(command)[0]


def _parse_python(command: list[str]) -> tuple[list[str], str, str, list[str]]:
    args = command[1:]
    i = 0
    while i < len(args):
        a = args[i]
        options = args[:i]
        if a in ("-m", "-c"):
            if i + 1 >= len(args):
                raise UserError(f"[job] command: {a} needs an argument")
            kind = "module" if a == "-m" else "code"
            return (options, kind, args[i + 1],
                    ([args[i + 1]] if kind == "module" else ["-c"]) + args[i + 2:])
        if a.startswith(("-m", "-c")) and len(a) > 2:
            kind = "module" if a[1] == "m" else "code"
            return options, kind, a[2:], ([a[2:]] if kind == "module" else ["-c"]) + args[i + 1:]
        if a in ("-W", "-X", "--check-hash-based-pycs"):
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return options, "script", a, args[i:]
    raise UserError(f"[job] command {command!r:.200}: python with no script, -m or -c")
