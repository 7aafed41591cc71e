"""deploy/slurm/lazarus.sbatch runs a real job to SUCCEEDED: the script as sbatch would run it
on the first node, with stand-ins for what only a Slurm cluster has (srun, and the node's
hostname; see slurm_standin/). Everything else is real: etcd, the daemon, an agent per "node",
a tiny training job on gloo, and `lazarus status` telling the script when the run is over.
The allocation is 3 nodes for a job of 2: the third is a warm spare."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from lazarus.core.embedded_etcd import free_port

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "lazarus.sbatch"
STANDIN = Path(__file__).resolve().parent / "slurm_standin"
STEPS = 6


def _port_pair() -> int:
    """A free port whose successor is free too (etcd's client and peer ports)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def _job(tmp: Path) -> Path:
    job = tmp / "job.toml"
    job.write_text(f"""\
[job]
name = "slurm-smoke"
nodes = 2
min_nodes = 1
nproc_per_node = 1
rendezvous_timeout_s = 60

[train]                  # the tiny model, tp 1, a small batch: the defaults
steps = {STEPS}
metrics = "{tmp / 'metrics.jsonl'}"
""")
    return job


def _sbatch_env(tmp: Path) -> dict[str, str]:
    """What Slurm puts in a batch script's environment, and the script's own settings."""
    return {**os.environ,
            "PATH": f"{STANDIN}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "3",
            "SLURM_CPUS_ON_NODE": str(os.cpu_count() or 1),
            "LAZARUS": str(Path(sys.executable).parent / "lazarus"),
            "LAZARUS_WORKDIR": str(tmp / "work"), "LAZARUS_ETCD_PORT": str(_port_pair()),
            "LAZARUS_API_PORT": str(free_port()), "LAZARUS_POLL_S": "1",
            "TMPDIR": str(tmp)}


@pytest.mark.e2e
def test_sbatch_runs_the_job_to_success_with_a_spare(tmp_path):
    proc = subprocess.Popen(["bash", str(SBATCH), str(_job(tmp_path))], cwd=tmp_path,
                            env=_sbatch_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the script did not end:\n{proc.communicate()[0]}\nlogs in "
                        f"{tmp_path / 'work'}")
        leftover = _group(proc.pid)
    finally:
        # The script stops everything itself; whatever it missed goes with its process group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    logs = tmp_path / "work"
    assert proc.returncode == 0, f"{out}\nlogs in {logs}"
    assert "lazarus: the run ended SUCCEEDED" in out, out
    # The `lazarus nodes` table the script prints last: the roles the script gave (the first
    # [job] nodes active, the rest of the allocation spare), and two nodes that ran the job
    # to the end (which two is the daemon's choice: a spare fills in for a node slow to start).
    nodes = {m[1]: (m[2], m[3]) for m in re.finditer(r"^(node\d)\s+(\w+)\s+(\w+)", out, re.M)}
    assert {n: role for n, (role, _) in nodes.items()} == {
        "node0": "active", "node1": "active", "node2": "spare"}, out
    assert sorted(state for _, state in nodes.values()) == ["spare", "succeeded", "succeeded"], out
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == STEPS
    # etcd ran TLS-only with authentication on; nobody can issue more of the job's certificates.
    assert "etcd authentication enabled" in (logs / "etcd-auth.log").read_text()
    assert "--client-cert-auth" in (SBATCH.read_text())
    assert (logs / "pki" / "ca.pem").exists() and not (logs / "pki" / "ca-key.pem").exists()
    # The agents share a replica key (tier-0 copies go to ring peers), private to the job.
    assert (logs / "replica-key").stat().st_mode & 0o077 == 0
    agent_logs = list(logs.glob("agent-*.log"))
    assert len(agent_logs) == 3 and not any("no replica key" in p.read_text() for p in agent_logs)
    # Nothing left running, and etcd's data (on the "node's" own disk) removed.
    assert leftover == [], leftover
    assert not list(tmp_path.glob("lazarus-etcd-*"))


def test_a_bad_job_file_fails_before_anything_starts(tmp_path):
    bad = tmp_path / "job.toml"
    bad.write_text("[job]\nnodes = 0\n")
    proc = subprocess.run(["bash", str(SBATCH), str(bad)], cwd=tmp_path,
                          env=_sbatch_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lazarus.sbatch: job file '{bad}'"), lines
    assert "nodes" in lines[0]
    assert not (tmp_path / "work").exists()


def _group(pgid: int) -> list[str]:
    """Live processes of a process group (zombies are gone already, only not yet reaped)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])}")
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out
