"""Under --run-as every job runs as the same user: what job A leaves behind on a node -- a
process that left its session, its home and caches -- must be gone before job B's ranks run
(lazarus.agent.jobfence, docs/security.md "The job's own code"). Run as root, with a uid no
account uses as the job user: the agent's real Workers, real processes of that user."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from lazarus.agent import jobfence
from lazarus.agent.workers import Workers
from lazarus.core.jobuser import JobUser

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as another user")


def _free_uid() -> int:
    import pwd

    used = {p.pw_uid for p in pwd.getpwall()}
    return next(u for u in range(47000, 48000) if u not in used)


def _left_behind(user: JobUser, marker: str) -> int:
    """Job A's move: a process of the job user that leaves its session and its parent (a
    double fork), holding a secret in its environment."""
    out = subprocess.run(
        ["/bin/sh", "-c", 'SECRET="$1" setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!',
         "sh", marker],
        capture_output=True, text=True, check=True, cwd="/", **user.popen_kwargs())
    return int(out.stdout)


def test_a_process_job_a_left_is_gone_before_job_b_runs(tmp_path):
    uid = _free_uid()
    user = JobUser("job", uid, uid, (), "")
    workers = Workers(nproc=1, env={}, log_dir=tmp_path / "logs", notes_dir=tmp_path,
                      park=False, user=user)
    bystander = subprocess.Popen(["sleep", "600"])  # the agent's own user: never swept
    try:
        assert workers.new_job("A") is True
        left = _left_behind(user, "job-a-secret")
        assert psutil.Process(left).uids().real == uid
        assert workers.new_job("A") is False     # the same job's rounds keep theirs
        assert psutil.pid_exists(left)
        assert workers.new_job("B") is True
        deadline = time.monotonic() + 30         # a hang guard: SIGKILL is prompt
        while psutil.pid_exists(left) and psutil.Process(left).status() != "zombie":
            assert time.monotonic() < deadline, "job A's process outlived the change of job"
            time.sleep(0.05)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        workers.shutdown()


def test_each_job_has_a_home_and_caches_of_its_own(tmp_path):
    uid = _free_uid()
    user = JobUser("job", uid, uid, (), "")
    (tmp_path / "job").mkdir()
    env_a = jobfence.job_env(user, tmp_path, "A")
    env_b = jobfence.job_env(user, tmp_path, "B")
    assert env_a["HOME"] != env_b["HOME"]
    for env in (env_a, env_b):
        assert env["TRITON_CACHE_DIR"].startswith(env["HOME"])
        assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(env["HOME"])
        assert os.stat(env["HOME"]).st_uid == uid
    poisoned = jobfence.job_home(tmp_path, "A") / ".cache" / "triton" / "kernel.py"
    poisoned.parent.mkdir(parents=True)
    poisoned.write_text("print('job A was here')")
    jobfence.forget_homes(tmp_path, keep_job="B")
    assert not jobfence.job_home(tmp_path, "A").exists()
    assert jobfence.job_home(tmp_path, "B").is_dir()
