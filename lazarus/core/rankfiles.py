"""The agent's access to files in directories its ranks write: rank logs, exit notes, stack
dumps, flight records and their pipes (docs/security.md, "A local user on a node").

Whoever runs the job's code can put anything at those paths: a symlink to a file of the
agent's (its etcd credentials, or /etc/shadow for a root agent), a FIFO that blocks an open
forever, a file of another user's. So the agent never follows a symlink there, opens without
blocking, and takes a file only when it is the kind it expects and belongs to a user it
trusts (its own; the job's user too, once ranks run as one). Anything else reads as absent.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

# Opened without following a final symlink and without blocking on a FIFO; never inherited.
_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# The ranks' own user, when they run as one (`lazarus agent --run-as`): one per agent process.
_job_uid: list[int] = []


def trust(uid: int) -> None:
    """Take the ranks' files as `uid`'s only: the user they run as (lazarus.core.jobuser).
    Files of the agent's own user there are then not the ranks': the agent's own logs
    (`open_log`), or something linked in."""
    _job_uid[:] = [uid]


def owners() -> frozenset[int]:
    """The users whose files in the ranks' directories the agent takes: the ranks' (the
    agent's own unless they run as a user of their own, whose files those all are)."""
    return frozenset(_job_uid or {os.geteuid()})


def _sound(st: os.stat_result, kind: int, uids: frozenset[int]) -> bool:
    """Of `kind`, owned by one of `uids`, and, a regular file, linked once: a hard link
    planted in the ranks' directory names another file of that owner's."""
    return (stat.S_IFMT(st.st_mode) == kind and st.st_uid in uids
            and (kind != stat.S_IFREG or st.st_nlink == 1))


def open_log(path: Path | str) -> int:
    """An fd appending to the agent's own log file at `path` in a directory the ranks' user
    owns (a zygote's, a cold worker's). Whatever else is at the name -- a symlink, a FIFO, a
    directory, a file of theirs or a hard link -- was planted: it is removed and the file
    made anew. Never raises: /dev/null when the name cannot be had."""
    me = frozenset({os.geteuid()})
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | _FLAGS, 0o600)
        except OSError:
            fd = -1
        if fd >= 0:
            if _sound(os.fstat(fd), stat.S_IFREG, me):
                return fd
            os.close(fd)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)  # not through symlinks
            else:
                os.unlink(path)
        except OSError:
            pass
    log.warning("log %s: its name is taken by something the ranks put there; output lost", path)
    return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)


def _open(path: Path | str, flags: int, kind: int) -> int:
    """An fd of `path` opened with `flags`, when it is a `kind` (stat.S_IFREG or S_IFIFO)
    owned by one of `owners()`; OSError otherwise (ELOOP for a symlink, ENXIO for a FIFO
    nobody reads)."""
    fd = os.open(path, flags | _FLAGS)
    try:
        st = os.fstat(fd)
        if not _sound(st, kind, owners()):
            raise PermissionError(f"{path}: not a {'file' if kind == stat.S_IFREG else 'pipe'} "
                                  f"of a trusted user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def size(path: Path | str) -> int:
    """The size of the regular file at `path` (not through a symlink); OSError otherwise."""
    st = os.lstat(path)
    if not _sound(st, stat.S_IFREG, owners()):
        raise PermissionError(f"{path}: not a file of a trusted user")
    return st.st_size


def is_file(path: Path | str) -> bool:
    try:
        size(path)
    except OSError:
        return False
    return True


def read(path: Path | str, *, offset: int = 0, limit: int = -1) -> bytes:
    """Up to `limit` bytes (all: -1) of the regular file at `path` from `offset`."""
    fd = _open(path, os.O_RDONLY, stat.S_IFREG)
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        return f.read(limit)


def read_tail(path: Path | str, nbytes: int) -> tuple[bytes, int]:
    """The last `nbytes` of the regular file at `path`, and its size."""
    fd = _open(path, os.O_RDONLY, stat.S_IFREG)
    with os.fdopen(fd, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(0, end - nbytes))
        return f.read(nbytes), end


def poke_pipe(path: Path | str) -> None:
    """Write one byte into the FIFO at `path`, which some rank reads; OSError when it is not
    a trusted FIFO or nobody reads it (ENXIO), never a wait."""
    fd = _open(path, os.O_WRONLY, stat.S_IFIFO)
    try:
        os.write(fd, b"1")
    finally:
        os.close(fd)


def rotate(path: Path | str, keep: Path | str) -> None:
    """Move the regular file `path`'s content into a new file `keep` (whatever was at `keep`
    is unlinked first, not written through) and empty `path`, in place: the rank appends to
    it on."""
    fd = _open(path, os.O_RDWR, stat.S_IFREG)
    with os.fdopen(fd, "r+b") as src:
        try:
            os.unlink(keep)
        except FileNotFoundError:
            pass
        out = os.open(keep, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o640)
        with os.fdopen(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.ftruncate(src.fileno(), 0)
