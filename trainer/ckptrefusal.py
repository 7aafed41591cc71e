"""Whether a failed DCP save is the storage refusing it (disk full, before or during the save;
read-only; gone), whatever form the error takes: an OSError, torch's short-write RuntimeError,
or DCP's exception wrapping either, on any rank. A refusal costs that checkpoint only
(trainer/ckptsave.py); anything else is a bug, and raises."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

_SHORT_WRITE = "a short write"


def storage_problem(e: CheckpointException, directory: Path) -> str | None:
    """'rank R: the OS error' when the storage refused a rank's part of a DCP save (a full
    disk, before or during the save; a read-only or vanished mount), whatever wraps it; None
    when something else failed (a bug to raise)."""
    for rank, failure in sorted(e.failures.items()):
        if why := _storage_error(failure[0] if isinstance(failure, tuple) else failure):
            if why.startswith(_SHORT_WRITE) and _nearly_full(directory):
                # the same words an OSError from a full disk carries, so an operator (and
                # anything matching on them) sees one cause whichever writer hit it
                why = f"{_SHORT_WRITE}: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: " \
                      f"{directory} has under 1 MiB free ({why[len(_SHORT_WRITE):].lstrip(' :')})"
            return f"rank {rank}: {why}"
    return None


def _nearly_full(directory: Path) -> bool:
    """Whether the file system holding `directory` (or its nearest existing parent) has under
    1 MiB free for this user."""
    for where in (directory, *directory.parents):
        try:
            st = os.statvfs(where)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize < 1 << 20
    return False


def _storage_error(exc: BaseException | None, depth: int = 0) -> str | None:
    """The storage's refusal in `exc`, its causes or, for DCP's own exception, its failures."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return str(exc)
    # torch's zip writer turns a short write (the disk filled during the save) into an
    # enforce failure, not an OSError: "[enforce fail at inline_container.cc:N] . unexpected
    # pos 704 vs 598", or "... PytorchStreamWriter failed writing file ...".
    text = str(exc)
    if isinstance(exc, RuntimeError) and "inline_container.cc" in text and (
            "unexpected pos" in text or "failed writing file" in text):
        return f"{_SHORT_WRITE} (the storage is likely full): {text}"
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if why := _storage_error(inner, depth + 1):
                return why
    return _storage_error(exc.__cause__ or exc.__context__, depth + 1)
