"""Where a job may make the agents' ranks write: under the roots the agent allows.

A job names paths its ranks write to and delete from (the checkpoint dir, the metrics file);
without a limit, whoever may submit a job could have every agent write or delete anywhere
the agent's user can. An agent is given its roots (`lazarus agent --allowed-root`, default its
workdir) and hands them to its ranks in their assignment; a rank refuses a job whose paths
fall outside them (exitcodes.REFUSED: the run fails with the reason, at once). What the agent
itself writes in a job's directory (its storage probes) goes through `open_dir`: only under
those roots, and never through a symlink the job's user planted below them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def outside(paths: Mapping[str, str | None], roots: Sequence[str]) -> str | None:
    """Why the job is refused: the first of `paths` (setting -> path; None: unset) that is not
    under one of `roots` once symlinks and '..' are resolved; None when all are, or when
    `roots` is empty (no limit: a `lazarus train` of the user's own)."""
    if not roots:
        return None
    real_roots = [os.path.realpath(r) for r in roots]
    for setting, path in paths.items():
        if path is None:
            continue
        real = os.path.realpath(path)
        if _root_of(real, real_roots) is None:
            return (f"{setting} {path} is outside the directories this node's agent lets jobs "
                    f"write to ({', '.join(roots)}; lazarus agent --allowed-root)")
    return None


def _root_of(real: str, real_roots: Sequence[str]) -> str | None:
    return next((r for r in real_roots
                 if real == r or real.startswith(r.rstrip(os.sep) + os.sep)), None)


def open_dir(path: str | os.PathLike, roots: Sequence[str]) -> int:
    """A descriptor (O_PATH) of the directory `path`, reached from the one of `roots` it lies
    under one component at a time with O_NOFOLLOW. Below a root everything may be the job
    user's: a component swapped for a symlink after `path` was resolved ends the walk
    (ENOTDIR, ELOOP) instead of leading the agent, with its rights, out of the roots. Open
    the file to write relative to it (dir_fd) with O_NOFOLLOW too. ValueError saying why when
    `path` is under none of `roots`; with no roots (no limit) `path` is opened as it is."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    if not roots:
        return os.open(path, flags)
    real = os.path.realpath(path)
    root = _root_of(real, [os.path.realpath(r) for r in roots])
    if root is None:
        raise ValueError(f"{os.fspath(path)} is outside the directories this node's agent lets "
                         f"jobs write to ({', '.join(roots)})")
    fd = os.open(root, flags)
    try:
        for part in filter(None, real[len(root):].split(os.sep)):
            below = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd
