"""Ranks under a Unix user of their own (`lazarus up --run-as USER`, docs/security.md): the job's
code runs as a second user, made by `deploy/job-user.sh`, which the cluster's root agents
start, watch, kill and recover in place; that user then tries what a hostile job would, and is
refused by the kernel: the cluster's credentials, the agent's files, its tier-0 store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lazarus.core.jobuser import JobUser
from tests.e2e.helpers import reference, train_table
from tests.e2e.test_recovery import run_up

REPO = Path(__file__).resolve().parents[2]
USER = "lazarus-job"


@pytest.fixture(scope="module")
def job_user() -> JobUser:
    if os.geteuid() != 0:
        pytest.skip("--run-as needs root: only root starts ranks as another user")
    subprocess.run(["bash", "deploy/job-user.sh", USER], cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    return JobUser.resolve(USER)


@pytest.fixture
def base():
    """A directory the job user can pass through (pytest's own are 0700, root's)."""
    d = Path(tempfile.mkdtemp(prefix="lazarus-run-as-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_user(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", USER, "--", *argv], capture_output=True, text=True,
                          timeout=60)


def test_ranks_of_their_own_user_recover_in_place_and_cannot_reach_the_clusters_secrets(
        job_user, base, tmp_path_factory):
    steps = 36
    summary, got = run_up(base, "--run-as", USER, "--nodes", "2", "--spares", "1",
                          "--steps", str(steps), "--memory-every", "2",
                          # storage saves at 30 and the end only: a save at 24 beat the
                          # node's kill (fired at step 23) on a loaded CI machine, and storage
                          # then held the newest step, rightly restored in place of memory
                          "--ckpt-every", "30",
                          "--chaos", "kill-worker@9:n1,kill-node@20:n1")
    assert summary["final_state"] == "SUCCEEDED", summary
    crash, lost = summary["recoveries"]
    assert (crash["detected_as"], crash["culprit"]) == ("worker_crash", "n1"), crash
    # the spare's new rank restores a copy it fetched from a peer, as the job's user
    assert (lost["detected_as"], lost["culprit"]) == ("node_lost", "n1"), lost
    assert lost["restored_from_tier"] == 0, lost
    spare = (base / "up" / "agent-n2.log").read_text()
    assert "fetched from n0" in spare, spare[-2000:]
    assert got == reference(tmp_path_factory.mktemp("ref"), train_table(steps), nproc=2, dp=2,
                            tp=1)
    up = base / "up"
    # The ranks ran as that user: they made their logs and the checkpoints.
    logs = sorted(up.glob("nodes/logs/n*/round-*/rank-*.log"))
    assert len(logs) >= 3, logs
    assert {p.stat().st_uid for p in logs} == {job_user.uid}
    steps_saved = sorted(up.glob("checkpoints/step-*"))
    assert steps_saved and {p.stat().st_uid for p in steps_saved} == {job_user.uid}
    # The survivor went on in place, as that user too.
    starts = [line for log in logs for line in log.read_text().splitlines()
              if "in place" in line and "model kept" in line]
    assert starts, "no rank went on in place"

    # What a hostile job tries, as its user: every one refused by the kernel.
    secrets = [up / "api-token", up / "replica-key", up / "etcd-client.json",
               *sorted((up / "etcd").rglob("*key*"))]
    assert len(secrets) > 3
    for path in secrets:
        r = _as_user("cat", str(path))
        assert r.returncode != 0 and "Permission denied" in r.stderr, (path, r)
    for directory in (up / "nodes", up / "nodes" / "stacks", up / "nodes" / "logs"):
        r = _as_user("ls", str(directory))  # passable, not listable
        assert r.returncode != 0 and "Permission denied" in r.stderr, (directory, r)
        r = _as_user("touch", str(directory / "planted"))
        assert r.returncode != 0, (directory, r)
    shm = [p for p in Path("/dev/shm").glob(f"lazarus-0-as-{job_user.uid}/*")]
    for node_dir in shm:  # the tier-0 store: kept copies readable, nothing writable but incoming
        for sub in ("local", "replica"):
            r = _as_user("touch", str(node_dir / sub / "planted"))
            assert r.returncode != 0, (node_dir, sub, r)


def test_a_non_root_agent_asked_to_run_as_another_user_says_it_cannot(job_user, base):
    """The agent checks before anything starts, and says why; no traceback."""
    r = _as_user(sys.executable, "-m", "lazarus.cli", "agent", "--etcd", "127.0.0.1:1",
                 "--workdir", str(base / "w"), "--run-as", "nobody")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "starts ranks as another user only as root or with CAP_CHOWN" in r.stderr
    assert "Traceback" not in r.stderr


AGENT = "lazarus-test-agent"  # an agent's own user that is not root, as the systemd unit's
CAPS = "+setuid,+setgid,+chown,+fowner,+kill,+dac_override"
PROBE = """
import subprocess, sys
from lazarus.core import jobuser
jobuser.check_agent_may_switch()
user = jobuser.JobUser.resolve(sys.argv[1])
print(subprocess.run(["grep", "-E", "^(Uid|Cap)", "/proc/self/status"], capture_output=True,
                     text=True, check=True, **user.popen_kwargs()).stdout)
"""


def test_an_agent_that_is_not_root_starts_ranks_that_hold_no_capability(job_user):
    """The systemd unit's agent: its own user, with the capabilities --run-as needs as
    ambient ones (AmbientCapabilities=). Its ranks, started as the job's user the way the
    agent starts them (JobUser.popen_kwargs), must hold none: ambient capabilities survive a
    change between two users that are not root, and an exec."""
    subprocess.run(["bash", "deploy/job-user.sh", AGENT], cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    r = subprocess.run(["setpriv", "--reuid", AGENT, "--regid", AGENT, "--init-groups",
                        "--inh-caps", CAPS, "--ambient-caps", CAPS, "--",
                        sys.executable, "-c", PROBE, USER],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    status = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    assert int(status["Uid"].split()[0]) == job_user.uid, status
    for field in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(status[field], 16) == 0, (field, status)
