"""A rank in the user's own Python: a job whose command names another interpreter by its path
(`/home/me/venv/bin/python train.py`, a conda env's, a container's) runs in that interpreter,
with its packages, and is watched as a rank in the agent's own is (docs/adopting.md, "Your
environment").

The parked worker (the agent's interpreter) takes the assignment and execs the job's
interpreter as `PYTHON [OPTIONS] -c BOOT THIS_FILE`. This file, run there, needs nothing but
the standard library until it has put the rank side of Lazarus on the import path: the
packages `lazarus`, `lazarus.core` and `lazarus.trainer`, from where the agent's installation
has them ($LAZARUS_RANK_SIDE), and nothing else of the agent's environment -- its torch, its
etcd and gRPC clients stay out of the job's way, the job's torch is the one the rank uses.
Then it runs the command as a warm rank would (lazarus.trainer.rankrun.run_here): its default
process group's joining and its collectives watched, the collective backstop applied, a lost
peer told by its exit code.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys

ROOTS_ENV = "LAZARUS_RANK_SIDE"
# The rank side's own packages; what they import beyond the standard library is torch (and
# numpy, where the job's torch has it), imported from the job's environment.
PACKAGES = ("lazarus", "lazarus.core", "lazarus.trainer")
# Runs in the job's interpreter: `-c` put the working directory first on sys.path, where a
# script's run would have its own directory (rankrun puts it there).
BOOT = ("import runpy, sys\n"
        "if sys.path and sys.path[0] == '': del sys.path[0]\n"
        "runpy.run_path(sys.argv[1], run_name='__lazarus_rankboot__')\n")
MIN_PYTHON = (3, 11)


def roots() -> dict[str, str]:
    """(In the agent's interpreter) where each of PACKAGES lives in this installation."""
    import importlib

    return {name: os.path.dirname(importlib.import_module(name).__file__) for name in PACKAGES}


def exec_args(python: str, options: list[str]) -> list[str]:
    """The argv that runs this file in interpreter `python` with its `options`."""
    return [python, *options, "-c", BOOT, os.path.abspath(__file__)]


class RankSide(importlib.abc.MetaPathFinder):
    """Finds PACKAGES where the agent's installation has them, before the job's own path:
    the rank side must be the agent's version, whatever the job's environment holds."""

    def __init__(self, where: dict[str, str]):
        self.where = where

    def find_spec(self, name, path=None, target=None):
        root = self.where.get(name)
        if root is None:
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(root, "__init__.py"), submodule_search_locations=[root])


def _boot() -> None:
    if sys.version_info < MIN_PYTHON:
        # The rank side cannot even be imported: said where the operator looks (the rank's
        # log, shown by the run's failure), not as a traceback.
        print(f"lazarus: the job's interpreter {sys.executable} is Python "
              f"{sys.version_info[0]}.{sys.version_info[1]}; a rank under Lazarus needs "
              f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer", file=sys.stderr, flush=True)
        os._exit(78)  # lazarus.core.exitcodes.REFUSED: no restart would do better
    where = json.loads(os.environ.pop(ROOTS_ENV))
    sys.meta_path.insert(0, RankSide({k: v for k, v in where.items() if k in PACKAGES}))
    # here: the finder above is what puts the rank side on this interpreter's path
    from lazarus.trainer import rankrun

    rankrun.run_own_python()


if __name__ == "__lazarus_rankboot__":
    _boot()
