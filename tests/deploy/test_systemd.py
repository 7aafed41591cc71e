"""The systemd units verify cleanly, rendered for this venv as docs/operations.md ("Deploying", systemd)
installs them (the ExecStart paths must exist: systemd-analyze checks them), and their
commands, with lazarus.env's settings, start a daemon and an agent that work together.
systemd-analyze knows nothing of our flags; only running the commands does."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from lazarus.core.embedded_etcd import EmbeddedEtcd, die_with_parent, free_port
from lazarus.core.etcd_rbac import AGENT_USER, DAEMON_USER
from lazarus.core.etcd_secure import LOOPBACK

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNITS = ("lazarus-daemon", "lazarus-agent")
# The venv path the units name; an installer swaps in its own.
SHIPPED_VENV = "/opt/lazarus/.venv"


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is missing: `apt-get install systemd` (deploy/setup-local.sh "
                    "does)")
    return found


def _render(dest: Path, source: Path = DEPLOY) -> list[Path]:
    venv = sys.prefix  # this test's venv has bin/lazarus, as an installed one would
    out = []
    for unit in UNITS:
        target = dest / f"{unit}.service"
        with open(target, "w") as f:
            subprocess.run(["sed", f"s|{SHIPPED_VENV}|{venv}|g", str(source / f"{unit}.service")],
                           stdout=f, check=True)
        out.append(target)
    return out


def _verify(units: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run([_systemd_analyze(), "verify", *map(str, units)],
                          capture_output=True, text=True, timeout=60)


def test_units_verify_without_a_warning(tmp_path):
    units = _render(tmp_path)
    assert all(SHIPPED_VENV not in u.read_text() for u in units)
    proc = _verify(units)
    # Unknown keys and bad values are only warnings (exit 0): any output is a finding.
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stderr


def test_verify_catches_a_misspelt_key(tmp_path):
    """The check above is worth something: a typo in a unit does not pass silently."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for unit in UNITS:
        text = (DEPLOY / f"{unit}.service").read_text()
        (broken / f"{unit}.service").write_text(text.replace("Restart=always", "Restart=alway"))
    proc = _verify(_render(tmp_path, broken))
    assert "alway" in proc.stderr, proc.stderr


def test_agent_unit_leaves_the_ranks_to_the_agent_and_always_restarts():
    """Ranks are to outlive an agent restart: systemd signals the agent alone."""
    agent = (DEPLOY / "lazarus-agent.service").read_text().splitlines()
    daemon = (DEPLOY / "lazarus-daemon.service").read_text().splitlines()
    assert "KillMode=process" in agent
    assert "Restart=always" in agent and "Restart=always" in daemon
    assert "StartLimitIntervalSec=0" in agent and "StartLimitIntervalSec=0" in daemon


def test_neither_unit_runs_as_root():
    """Issue 23: the agent ran as root, and so did every job's code it starts."""
    agent = (DEPLOY / "lazarus-agent.service").read_text().splitlines()
    daemon = (DEPLOY / "lazarus-daemon.service").read_text().splitlines()
    users = [line.split("=", 1)[1] for line in agent if line.startswith("User=")]
    assert users == ["lazarus"] and "NoNewPrivileges=yes" in agent
    assert "DynamicUser=yes" in daemon


def test_env_file_sets_every_variable_the_units_use():
    env = {line.split("=", 1)[0] for line in (DEPLOY / "lazarus.env").read_text().splitlines()
           if line and not line.startswith("#")}
    used = set()
    for unit in UNITS:
        text = (DEPLOY / f"{unit}.service").read_text()
        used |= {part.split("}", 1)[0] for part in text.split("${")[1:]}
    assert used <= env, used - env


def _exec_start(unit: Path, env: dict[str, str], specifiers: dict[str, str]) -> list[str]:
    """ExecStart as systemd runs it: continuation lines joined, %-specifiers and ${VAR}
    substituted (each ${VAR} one word), then split into words."""
    text = unit.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    line = line.removeprefix("ExecStart=")
    for spec, value in specifiers.items():
        line = line.replace(spec, value)
    return [re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], word) for word in shlex.split(line)]


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line and not line.startswith("#"))


def _credentials(unit: Path, security, dest: Path) -> Path:
    """What the unit's LoadCredential= lines hand it, from a secure etcd's files: the
    credentials directory, %d."""
    user = DAEMON_USER if unit.stem == "lazarus-daemon" else AGENT_USER
    api = security.ca.issue("api", server=True, hosts=LOOPBACK)
    files = {"etcd-ca": security.ca.ca_file, "etcd-cert": security.client.cert,
             "etcd-key": security.client.key, "etcd-password": security.password_files[user],
             "api-cert": api.cert, "api-key": api.key}
    dest.mkdir()
    (dest / "token").write_text("deploy-test-token\n")
    (dest / "token").chmod(0o400)  # as LoadCredential= hands it over
    files["replica-key"] = dest / "replica-key.source"
    files["replica-key"].write_text("0123456789abcdef" * 4 + "\n")
    files["submit-token"] = dest / "submit-token.source"  # the users': not the admin token
    files["submit-token"].write_text("deploy-test-submit-token\n")
    loaded = re.findall(r"^LoadCredential=([\w-]+):", unit.read_text(), re.M)
    for name in loaded:
        if name != "token":
            (dest / name).write_bytes(files[name].read_bytes())
            (dest / name).chmod(0o400)  # as LoadCredential= hands it over
    return dest


# Who the agent unit runs as here: a user of its own (the unit's `lazarus`, made by the
# test), and the ranks' user the shipped lazarus.env names.
AGENT_STANDIN = "lazarus-test-agent"


def _as_agent_unit(unit: Path) -> list[str]:
    """The agent unit's user, capabilities and no-new-privileges, as systemd applies them."""
    text = unit.read_text()
    caps = re.search(r"^AmbientCapabilities=(.+)$", text, re.M)[1].split()
    bounding = re.search(r"^CapabilityBoundingSet=(.+)$", text, re.M)[1].split()
    spec = ",".join("+" + c.removeprefix("CAP_").lower() for c in caps)
    assert "NoNewPrivileges=yes" in text
    return ["setpriv", "--reuid", AGENT_STANDIN, "--regid", AGENT_STANDIN, "--init-groups",
            "--no-new-privs", "--inh-caps", spec, "--ambient-caps", spec, "--bounding-set",
            "-all," + ",".join("+" + c.removeprefix("CAP_").lower() for c in bounding)]


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def test_the_units_commands_run_a_daemon_and_an_agent(tmp_path):
    """The agent as its unit runs it: a user of its own with the unit's capabilities, its
    ranks' processes (the zygote every rank forks from) as the ranks' user with none."""
    if os.geteuid() != 0:
        pytest.skip("the agent unit runs as a user of its own, its ranks as another: needs root")
    env_file = _env_file(DEPLOY / "lazarus.env")
    for user in (AGENT_STANDIN, env_file["LAZARUS_RUN_AS"]):
        subprocess.run(["bash", "deploy/job-user.sh", user], cwd=DEPLOY.parents[1], check=True,
                       capture_output=True, timeout=120)
    agent_uid = pwd.getpwnam(AGENT_STANDIN).pw_uid
    job_uid = pwd.getpwnam(env_file["LAZARUS_RUN_AS"]).pw_uid
    # what systemd's StateDirectory= and LoadCredential= make: the agent user's, reachable
    base = Path(tempfile.mkdtemp(prefix="lazarus-unit-"))
    units = _render(tmp_path)
    api = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        os.chown(base, agent_uid, -1)
        os.chmod(base, 0o711)
        # etcd as the units expect it: TLS with client certificates, authentication on
        with EmbeddedEtcd(tmp_path / "etcd", secure=True) as etcd:
            # lazarus.env as shipped, but for this machine: its etcd, a local API, a spare.
            env = {**env_file, "LAZARUS_ETCD": f"https://{etcd.endpoint}",
                   "LAZARUS_API": api, "LAZARUS_WORKDIR": str(base / "work"),
                   "LAZARUS_NPROC": "1", "LAZARUS_ROLE": "spare"}
            try:
                for unit in units:
                    agent = unit.stem == "lazarus-agent"
                    creds = _credentials(unit, etcd.security,
                                         (base if agent else tmp_path) / f"credentials-{unit.stem}")
                    if agent:
                        for path in (creds, *creds.iterdir()):
                            os.chown(path, agent_uid, -1)
                    specifiers = {"%H": "localhost", "%d": str(creds)}
                    log = open(tmp_path / f"{unit.stem}.log", "wb")
                    procs.append(subprocess.Popen(
                        [*(_as_agent_unit(unit) if agent else []),
                         *_exec_start(unit, env, specifiers)],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        preexec_fn=die_with_parent, env={**os.environ, **env}, cwd=base))
                    log.close()
                nodes = _wait_for_nodes(api, tmp_path / "credentials-lazarus-daemon", procs,
                                        tmp_path)
                # the users' token the unit loads is the daemon's submit token: it reads
                as_user = _wait_for_nodes(api, tmp_path / "credentials-lazarus-daemon", procs,
                                          tmp_path, token="submit-token")
                zygote = _wait_for_zygote(procs[1].pid, tmp_path)
                agent_status, zygote_status = _status(procs[1].pid), _status(zygote)
            finally:
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)  # what `systemctl stop` sends
                for proc in procs:
                    proc.wait(timeout=60)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert [(n["node"], n["role"], n["state"]) for n in nodes] == [("localhost", "spare", "spare")]
    assert [n["node"] for n in as_user] == ["localhost"]
    # Both stopped cleanly on SIGTERM, as TimeoutStopSec expects.
    assert [proc.returncode for proc in procs] == [0, 0]
    assert int(agent_status["Uid"].split()[0]) == agent_uid
    assert int(agent_status["CapEff"], 16) != 0  # it has what --run-as takes ...
    assert int(zygote_status["Uid"].split()[0]) == job_uid
    for field in ("CapInh", "CapPrm", "CapEff", "CapAmb"):  # ... and its ranks have none
        assert int(zygote_status[field], 16) == 0, (field, zygote_status)


def _wait_for_zygote(agent: int, logs: Path) -> int:
    """The pid of the agent's worker zygote, once it runs (a hang guard, not a timing)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for child in psutil.Process(agent).children():
            if "--zygote" in child.cmdline():
                return child.pid
        time.sleep(0.2)
    pytest.fail(f"the agent started no zygote; logs in {logs}")


def _wait_for_nodes(api: str, creds: Path, procs: list[subprocess.Popen], logs: Path,
                    token: str = "token") -> list:
    """`lazarus nodes --json` with the credential `token` once the agent has registered (a
    hang guard, not a timing); a token the daemon refuses fails at once."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[1]} exited; logs in {logs}"
        out = subprocess.run([str(Path(sys.prefix) / "bin" / "lazarus"), "nodes", "--address",
                              api, "--token-file", str(creds / token), "--tls-ca",
                              str(creds / "etcd-ca"), "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 4, out.stderr  # the token refused
        if out.returncode == 0:
            nodes = json.loads(out.stdout).get("nodes", [])
            if nodes:
                return nodes
        time.sleep(0.5)
    pytest.fail(f"no node registered; logs in {logs}")
