"""A worker's side of stack capture: its Python stacks, dumped on SIGUSR1 into the file the
agent reads (lazarus.core.contract.dump_path). faulthandler writes from a C signal handler, so
it answers even when the main thread is blocked inside a collective -- a hung rank's state."""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path

from lazarus.core.contract import dump_path

_dump_file = None  # kept open for the life of the process: the handler writes to its fd


def enable_stack_dumps(dump_dir: str | Path) -> Path:
    """Worker side: dump all threads' stacks to dump_dir/stacks-<pid>.txt on SIGUSR1."""
    global _dump_file
    Path(dump_dir).mkdir(parents=True, exist_ok=True)
    path = dump_path(dump_dir, os.getpid())
    _dump_file = open(path, "a", encoding="utf-8")
    faulthandler.register(signal.SIGUSR1, file=_dump_file, all_threads=True)
    return path
