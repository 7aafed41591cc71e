"""Where a job may make the agents' ranks write: under the roots the agent allows.

A job names paths its ranks write to and delete from (the checkpoint dir, the metrics file);
without a limit, whoever may submit a job could have every agent write or delete anywhere
the agent's user can. An agent is given its roots (`lazarus agent --allowed-root`, default its
workdir) and hands them to its ranks in their assignment; a rank refuses a job whose paths
fall outside them (exitcodes.REFUSED: the run fails with the reason, at once).
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
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in real_roots):
            return (f"{setting} {path} is outside the directories this node's agent lets jobs "
                    f"write to ({', '.join(roots)}; lazarus agent --allowed-root)")
    return None
