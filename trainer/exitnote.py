"""A rank's exit code, left in a file for an agent that is not its parent.

Ranks outlive an agent restart, and the new agent adopts them (lazarus.agent.adopt): it
cannot wait() for processes it did not start, so it would see them vanish without knowing
whether they finished or crashed. Each rank therefore writes its exit code next to its stack
dumps (lazarus.core.contract.exit_note_path) just before it exits, with its start time, so
a note left by an earlier process that had the same pid is never taken for its own.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback
from typing import NoReturn

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
        tmp.write_text(json.dumps({"pid": pid, "started": start_time(pid), "code": code}))
        os.replace(tmp, path)  # the agent reads a whole note or none
    except OSError:
        pass  # the agent then counts this exit as a crash: the safe side


def start_time(pid: int) -> float:
    """When `pid` started, on psutil's clock (the agent's: lazarus.agent.adopt.start_time).
    Without psutil (a rank in the user's own environment, lazarus.trainer.rankboot): psutil's
    own formula, the boot time plus the start in clock ticks, from /proc."""
    try:
        import psutil
    except ImportError:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    return psutil.Process(pid).create_time()


def exit_now(code: int) -> NoReturn:
    """os._exit (no teardown of a process group whose peer may be gone) with a note."""
    record(code)
    os._exit(code)


def finish(code: int) -> NoReturn:
    """Exit as the interpreter would after a rank's work, less its teardown of torch: the
    atexit handlers run and the output is flushed, then the process ends without destroying
    the C++ threads a process group or store left unjoined -- destroying one aborts the
    process after its work is done (torch's abort at exit, docs/constraints.md)."""
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(code)
