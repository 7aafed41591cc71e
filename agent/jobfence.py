"""What one job leaves on a node must not reach the next, when the ranks run as a user of
their own (--run-as): every job runs as that same uid, so a process job A left behind could
read job B's ranks (/proc/PID/environ, their memory) and a cache A poisoned (Triton's,
Inductor's, pip's in HOME) would run A's code in B (docs/security.md, "The job's own code").

At a change of job the agent ends every process of that uid (`sweep`) -- stragglers that left
their session, the zygote and the parked workers forked for the old job -- and each job gets a
home and cache directories of its own (`job_env`), removed once another job runs.

Without --run-as the ranks are the agent's own user and nothing here applies: a job can then
reach what the agent can, as docs/security.md says.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
from pathlib import Path

import psutil

from lazarus.core.jobuser import JobUser, job_dir

log = logging.getLogger("lazarus.agent")


def _tag(job_id: str) -> str:
    return hashlib.sha256(job_id.encode()).hexdigest()[:16]


def job_home(workdir: Path, job_id: str) -> Path:
    return job_dir(workdir) / "homes" / _tag(job_id)


def job_env(user: JobUser, workdir: Path, job_id: str) -> dict[str, str]:
    """The home and caches of `job_id`'s ranks: a directory of the job user's, this job's
    alone. A job's own setting of any of these (its `env`) still wins."""
    home = user.give(job_home(workdir, job_id))
    cache = home / ".cache"
    return {"HOME": str(home), "XDG_CACHE_HOME": str(cache),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}


def forget_homes(workdir: Path, keep_job: str) -> None:
    """Remove the homes of every job but `keep_job` (rmtree does not follow the links a job
    may have left in them)."""
    homes = job_dir(workdir) / "homes"
    keep = _tag(keep_job)
    try:
        entries = list(homes.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name != keep:
            shutil.rmtree(entry, ignore_errors=True)


def sweep(uid: int, *, spare: set[int]) -> list[int]:
    """SIGKILL every process whose real or effective uid is `uid`, but the pids in `spare`:
    the pids killed. The agent's own uid is never `uid` (lazarus.core.jobuser refuses it)."""
    assert uid not in (0, os.geteuid()), "a sweep of the agent's own user"
    killed = []
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uids is None or proc.pid in spare or uid not in (uids.real, uids.effective):
            continue
        try:
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed
