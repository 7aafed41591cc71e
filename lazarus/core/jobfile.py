"""The daemon's reads of files a job controls: a checkpoint's manifest in the job's checkpoint
dir (docs/security.md, "The job's own code").

The job's ranks run whatever code the job names, as its user, and write its checkpoint dir:
at any path there they may have put a FIFO (open() blocks on it until a writer comes, for
ever), a symlink to a file of the daemon's, or a sparse file of any size. `read_job_file`
opens neither the file nor its directory through a symlink, never blocks in open(), takes a
regular file only and reads at most `cap` bytes of it; anything else is refused with a
`JobFileError` saying what was there. It does not bound the time a read takes on a mount
that hangs: callers that must not wait run it beside their loop (lazarus.daemon.ckptcheck).
"""

from __future__ import annotations

import errno
import os
import stat

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO opens at once instead of waiting for a writer (and fstat then refuses
# it); on a regular file it changes nothing.
_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


class JobFileError(ValueError):
    """A file the job controls that is not one to read; `what` says what is there ("is a
    FIFO, not a regular file")."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path} {what}")
        self.path, self.what = path, what


def read_job_file(path: str | os.PathLike, cap: int) -> bytes:
    """The bytes of the regular file at `path`, of at most `cap` bytes. JobFileError when it
    or its directory is a symlink, it is no regular file, or it is larger than `cap`;
    OSError when it cannot be opened (missing, no permission)."""
    path = os.fspath(path)
    parent, name = os.path.split(path)
    try:
        dfd = os.open(parent or ".", _DIR)
    except OSError as e:
        # O_DIRECTORY | O_NOFOLLOW on a symlink fails ENOTDIR (ELOOP on some kernels)
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(parent):
            raise JobFileError(path, "is in a directory that is a symlink") from None
        raise
    try:
        fd = os.open(name, _FILE, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise JobFileError(path, "is a symlink") from None
        raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "something else")
            raise JobFileError(path, f"is {kind}, not a regular file")
        if st.st_size > cap:
            raise JobFileError(path, f"is {st.st_size} bytes, more than {cap}")
        chunks, got = [], 0
        while got <= cap:  # cap + 1 at most: a file that grew since fstat is refused too
            chunk = os.read(fd, min(cap + 1 - got, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > cap:
            raise JobFileError(path, f"is more than {cap} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)

