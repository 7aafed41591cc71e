"""A rank's exit code, left in a file for an agent that is not its parent.

Ranks outlive an agent restart, and the new agent adopts them (lazarus.agent.adopt): it
cannot wait() for processes it did not start, so it would see them vanish without knowing
whether they finished or crashed. Each rank therefore writes its exit code next to its stack
dumps (lazarus.core.contract.exit_note_path) just before it exits, with its start time, so
a note left by an earlier process that had the same pid is never taken for its own.
"""

from __future__ import annotations

import json
import os
from typing import NoReturn

import psutil

from lazarus.core.contract import STACKS_ENV, exit_note_path


def record(code: int) -> None:
    """Leave `code` for the agent; nothing without an agent (no dump dir in the environment)."""
    dump_dir = os.environ.get(STACKS_ENV)
    if not dump_dir:
        return
    pid = os.getpid()
    path = exit_note_path(dump_dir, pid)
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"pid": pid, "started": psutil.Process(pid).create_time(),
                                   "code": code}))
        os.replace(tmp, path)  # the agent reads a whole note or none
    except OSError:
        pass  # the agent then counts this exit as a crash: the safe side


def exit_now(code: int) -> NoReturn:
    """os._exit (no teardown of a process group whose peer may be gone) with a note."""
    record(code)
    os._exit(code)
