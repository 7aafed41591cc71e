"""deploy/slurm/lazarus.sbatch runs a real job to SUCCEEDED: the script as sbatch would run it
on the first node, with stand-ins for what only a Slurm cluster has (srun, and the node's
hostname; see slurm_standin/). Everything else is real: etcd, the daemon, an agent per "node",
a tiny training job on gloo, and `lazarus status` telling the script when the run is over.
The allocation is 3 nodes for a job of 2: the third is a warm spare. A cheaper run, with
stand-ins for lazarus and etcd too, checks what the script hands the agents: no allowed root
holds the job's secrets."""

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

from lazarus.core import jobpaths
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
metrics = "{tmp / 'work' / 'metrics.jsonl'}"  # under the default allowed root
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
             (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == STEPS
    # etcd ran TLS-only with authentication on; nobody can issue more of the job's certificates.
    assert "etcd authentication enabled" in (logs / "etcd-auth.log").read_text()
    assert "--client-cert-auth" in (SBATCH.read_text())
    secrets = tmp_path / "work-secrets"
    assert (secrets / "pki" / "ca.pem").exists() and not (secrets / "pki" / "ca-key.pem").exists()
    # The agents share a replica key (tier-0 copies go to ring peers), private to the job.
    assert (secrets / "replica-key").stat().st_mode & 0o077 == 0
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


# What the script runs, reduced to saying how it was run: each agent and the daemon write
# their arguments (and the agents their etcd credentials) to $OUT, then wait to be stopped.
_FAKE_LAZARUS = r"""#!/usr/bin/env bash
case "$1 $2" in
    "etcd certs") mkdir -p "$3"
        for f in ca ca-key server server-key client client-key; do : >"$3/$f.pem"; done ;;
    "etcd enable-auth") for u in root lazarus-daemon lazarus-agent; do : >"$4/$u.password"; done ;;
    "daemon "*) printf '%s\n' "$@" >"$OUT/daemon.args"; exec sleep 60 ;;
    "agent "*) { printf '%s\n' "$@"; env | grep '^LAZARUS_ETCD_' | sed 's/^[^=]*=//'; } \
                   >"$OUT/agent-$SLURMD_NODENAME.args"; exec sleep 60 ;;
    "status "*) echo '{"state": "SUCCEEDED"}' ;;
esac
"""


def _fake_run(tmp: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    bin_, out = tmp / "bin", tmp / "out"
    bin_.mkdir()
    out.mkdir()
    for name, text in (("lazarus", _FAKE_LAZARUS), ("etcd", "#!/bin/sh\nexec sleep 60\n"),
                       ("python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    proc = subprocess.run(
        ["bash", str(SBATCH), str(_job(tmp))], cwd=tmp, capture_output=True, text=True,
        timeout=60, env={**_sbatch_env(tmp), "PATH": f"{STANDIN}:{bin_}:{os.environ['PATH']}",
                         "LAZARUS": str(bin_ / "lazarus"), "LAZARUS_POLL_S": "0.2",
                         "OUT": str(out), **env})
    return proc, out


def test_no_allowed_root_holds_the_jobs_secrets(tmp_path):
    """A job file may point its checkpoint dir (where retention deletes) anywhere under the
    agents' allowed roots: none may hold the API token, the replica key or the pki."""
    proc, out = _fake_run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    daemon = (out / "daemon.args").read_text().splitlines()
    secrets = [daemon[daemon.index("--token-file") + 1]]
    for node in ("node0", "node1", "node2"):
        args = (out / f"agent-{node}.args").read_text().splitlines()
        roots = [args[i + 1] for i, a in enumerate(args) if a == "--allowed-root"]
        assert roots, args
        secrets.append(args[args.index("--replica-key-file") + 1])
        secrets += [a for a in args if "/pki/" in a]  # the etcd client's files
        for path in secrets:
            assert Path(path).exists(), path
            # The agent's own check: a job naming this path is refused.
            assert jobpaths.outside({"checkpoint.dir": path}, roots) is not None, (path, roots)
    assert len(secrets) > 6
    assert Path(secrets[0]).parent.stat().st_mode & 0o077 == 0


def test_an_allowed_root_over_the_secrets_is_refused_before_anything_starts(tmp_path):
    proc, out = _fake_run(tmp_path, LAZARUS_ALLOWED_ROOTS=f"/nonexistent:{tmp_path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "overlaps LAZARUS_SECRETS" in proc.stderr
    assert not (tmp_path / "work").exists() and list(out.iterdir()) == []


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
