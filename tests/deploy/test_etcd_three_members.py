"""docs/operations.md's three-member etcd ("Securing etcd", "A three-member etcd with TLS") run
as written on one machine: the certificates from its `lazarus etcd certs --hosts ...` line, the
three members from its `etcd --name ...` lines, authentication from its `lazarus etcd
enable-auth` line, and a client from its `export LAZARUS_ETCD...` line. The lines are taken
from the docs' fenced blocks (continuations joined, comments dropped); the etcd lines run
under bash, as an operator's shell runs them.

On the same three members (a module fixture: etcd is started once), "Your first cluster" runs
as written, step by step: the API's certificate and the three tokens, two daemons, three agents
(one a spare), `lazarus status` and `lazarus nodes` with both daemons' addresses, a user's
`lazarus run` with the submit token (a tiny gloo DDP script of tests/e2e/scripts, level 0,
that resumes from its own snapshot), a drain the submit token is refused, `lazarus chaos
kill-worker` on node-2, the recovery in `lazarus events`, and the run's end.

One machine is not three hosts, so the text is changed in these ways and no other:
- `etcd-N.example` -> 127.0.0.N: Linux routes all of 127/8 to loopback, so these are three
  addresses without /etc/hosts; in member N's line, `0.0.0.0` -> 127.0.0.N too, since three
  members cannot all listen on every address, and so in the daemon's line on etcd-N;
- the ports 2379, 2380 and 7070 -> free ports (the same on every address);
- /etc/lazarus/pki and /etc/lazarus/etcd -> the test's pki directory, /var/lib/etcd -> a data
  directory per member; in the walk-through, /etc/lazarus -> the test's etc, /var/lib/lazarus
  -> a workdir per node, /checkpoints -> the test's storage, `~` -> the user's home there;
- the nodes' addresses 10.0.0.2N -> 127.0.0.1, and their 8 ranks (`--nproc 8`,
  `--nproc-per-node 8`) -> 1: the machine has a few CPUs and no GPU;
- the install step (a venv and pip) is skipped: the test runs this checkout's venv, and
  `lazarus ...` is `python -m lazarus.cli ...` of it. Each host gets its own LAZARUS_HOME.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import die_with_parent, free_port
from lazarus.core.etcd_auth import EtcdAuth

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "operations.md"
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "ddp_snapshot.py"  # a torchrun DDP script, level 0
MEMBERS = (1, 2, 3)
NODES = (1, 2, 3)
START_S = 20  # a hang guard: three members on loopback elect a leader in about a second
DEADLINE_S = 180  # a hang guard for the walk-through's waits on a busy machine, not a timing
KEY = "/lazarus/v1/test/three-members"  # under the root, where lazarus-daemon may write


def documented_lines(title: str = "Securing etcd") -> list[str]:
    """The commands of the fenced blocks of a section (with its subsections)."""
    section = DOCS.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    lines, pending = [], ""
    for block in re.findall(r"^```\w*\n(.*?)^```", section, re.M | re.S):
        for line in block.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            if (pending + line).strip():
                lines.append(" ".join((pending + line).split()))
            pending = ""
    return lines


def the(lines: list[str], start: str) -> list[str]:
    found = [line for line in lines if line.startswith(start)]
    assert found, f"docs/operations.md: no line starting {start!r}"
    return found


class Here:
    """The substitutions of the module docstring."""

    def __init__(self, tmp: Path):
        self.tmp, self.pki = tmp, tmp / "pki"
        self.client_port, self.peer_port = free_port(), free_port()
        self.api_port = free_port()

    def __call__(self, text: str, member: int | None = None) -> str:
        for n in MEMBERS:
            text = text.replace(f"etcd-{n}.example", f"127.0.0.{n}")
        if member is not None:
            text = (text.replace("0.0.0.0", f"127.0.0.{member}")
                    .replace("/var/lib/etcd", str(self.tmp / f"data-{member}")))
        text = (text.replace(":2379", f":{self.client_port}")
                .replace(":2380", f":{self.peer_port}").replace(":7070", f":{self.api_port}"))
        text = text.replace("/etc/lazarus/pki", str(self.pki)).replace("/etc/lazarus/etcd",
                                                                      str(self.pki))
        return (text.replace("/etc/lazarus/", f"{self.tmp}/etc/")
                .replace("/checkpoints", str(self.tmp / "checkpoints"))
                .replace("~/", f"{self.home}/"))

    @property
    def home(self) -> Path:
        """The user's home of the walk-through."""
        return self.tmp / "user"

    def on_node(self, text: str, n: int) -> str:
        """A walk-through line on node-N: its workdir, its 127.0.0.1, one rank."""
        text = text.replace("/var/lib/lazarus", str(self.tmp / f"node-{n}"))
        text = re.sub(r"10\.0\.0\.2\d", "127.0.0.1", text)
        return re.sub(r"(--nproc(?:-per-node)?) 8\b", r"\1 1", self(text))

    def endpoint(self, member: int) -> str:
        return f"127.0.0.{member}:{self.client_port}"


def lazarus(line: str, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """A documented `lazarus ...` line, run by this interpreter's lazarus.cli."""
    return subprocess.run(_argv(line), capture_output=True, text=True, timeout=120, env=env,
                          cwd=cwd)


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)
    assert argv[0] == "lazarus", line
    return [sys.executable, "-m", "lazarus.cli", *argv[1:]]


def exported(line: str) -> dict[str, str]:
    """`export A=x B=y` -> {A: x, B: y}."""
    words = shlex.split(line)
    assert words[0] == "export", line
    return dict(word.split("=", 1) for word in words[1:])


def until(what: str, fn, procs: dict[int, subprocess.Popen], logs: Path):
    deadline = time.monotonic() + START_S
    while True:
        for n, proc in procs.items():
            assert proc.poll() is None, f"etcd member {n} exited {proc.returncode}: {logs}"
        try:
            return fn()
        except E.EtcdUnavailable as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: {e} (logs in {logs})") from None
            time.sleep(0.2)


@dataclass
class Members:
    """The three members, started from the docs' lines, authentication on."""
    here: Here
    lines: list[str]                  # "Securing etcd"'s commands
    run: list[str]                    # those of them run here, as written
    certs: subprocess.CompletedProcess
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("three-members")
    lines = documented_lines()
    here = Here(tmp)
    certs_line, = [line for line in the(lines, "lazarus etcd certs") if "--hosts" in line]
    certs = lazarus(here(certs_line))
    assert certs.returncode == 0, certs.stderr
    found = Members(here, lines, [certs_line], certs)
    cert_only = EtcdAuth.load(ca=str(here.pki / "ca.pem"), cert=str(here.pki / "client.pem"),
                              key=str(here.pki / "client-key.pem"), env={})
    lines_of_members = the(lines, "etcd --name")
    assert len(lines_of_members) == 3, lines_of_members
    try:
        for n, line in zip(MEMBERS, lines_of_members):
            assert f"--name etcd-{n} " in line, line
            with open(tmp / f"etcd-{n}.log", "wb") as log:
                found.procs[n] = subprocess.Popen(
                    ["bash", "-c", "exec " + here(line, n)], stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        for n in MEMBERS:  # a linearizable read: the member serves, with a quorum behind it
            member = E.Etcd(here.endpoint(n), auth=cert_only)
            try:
                until(f"member {n} serving", lambda: member.get(KEY), found.procs, tmp)
            finally:
                member.close()
        enable_line = the(lines, "lazarus etcd enable-auth")[0]
        enable = lazarus(here(enable_line))
        assert enable.returncode == 0, enable.stderr
        found.run.append(enable_line)
        yield found
    finally:
        for proc in found.procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


# -- "Your first cluster" ------------------------------------------------------------------------
# What the walk-through has the operator and the user type, checked to be in its lines: the
# commands and options tests/documented_commands.toml maps to the test below.
WALKTHROUGH = ("lazarus daemon", "--etcd", "--etcd-ca", "--etcd-cert", "--etcd-key",
               "--etcd-user", "--etcd-password-file", "--api", "--tls-cert", "--tls-key",
               "--token-file", "--read-token-file", "--submit-token-file",
               "lazarus agent", "--node", "--host", "--nproc", "--role active", "--workdir",
               "--allowed-root", "lazarus status", "lazarus nodes", "--address", "--tls-ca",
               "lazarus run", "--nodes", "--nproc-per-node", "lazarus drain",
               "lazarus chaos kill-worker", "lazarus events")
# The install step: the test runs this checkout's venv instead.
INSTALL = ("python3 -m venv ", "export PATH=")


class Lines:
    """A running command's stdout, line by line, kept for the assertions."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.seen = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.seen.append(line.rstrip("\n"))

    def rest(self) -> list[str]:
        self.proc.wait(timeout=DEADLINE_S)
        self._thread.join(timeout=10)
        return self.seen


class Cluster:
    """The walk-through's hosts on this machine: the processes it starts, each host's
    environment (a LAZARUS_HOME of its own, no LAZARUS_ variable of the test's)."""

    def __init__(self, here: Here):
        self.here, self.procs, self.logs = here, {}, here.tmp / "logs"
        self.logs.mkdir()

    def env(self, host: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LAZARUS_")}
        home = self.here.home if host == "user" else self.here.tmp / f"home-{host}"
        env.update(HOME=str(home), LAZARUS_HOME=str(home / ".lazarus"), **(extra or {}))
        return env

    def start(self, host: str, line: str) -> None:
        with open(self.logs / f"{host}.log", "wb") as log:
            self.procs[host] = subprocess.Popen(
                _argv(line), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env(host), preexec_fn=die_with_parent, start_new_session=True)

    def alive(self) -> None:
        for host, proc in self.procs.items():
            assert proc.poll() is None, (f"{host} exited {proc.returncode}: "
                                         f"{(self.logs / f'{host}.log').read_text()[-3000:]}")

    def wait_for(self, what: str, fn):
        deadline = time.monotonic() + DEADLINE_S
        while (found := fn()) is None:
            self.alive()
            assert time.monotonic() < deadline, f"never {what}; logs in {self.logs}"
            time.sleep(0.5)
        return found

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            with_children = proc.pid  # its session: the agent's zygote and parked workers
            try:
                os.killpg(with_children, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _rank_running(workdir: Path) -> bool:
    """Whether a rank of the node has printed an epoch: the script trains."""
    return any("epoch" in log.read_text() for log in workdir.glob("logs/*/round-*/rank-*.log"))


def test_your_first_cluster_as_written_recovers_a_users_run(members):
    here = members.here
    lines = documented_lines("Your first cluster")
    text = " ".join(lines)
    missing = [word for word in WALKTHROUGH if not re.search(rf"{re.escape(word)}(?![\w-])",
                                                             text)]
    assert not missing, missing
    # Step 2 is "Securing etcd"'s own lines, which the fixture ran on the three members.
    etcd_lines = [line for line in lines if line.startswith("lazarus etcd ")
                  and "/etc/lazarus/api" not in line]
    assert etcd_lines == members.run, (etcd_lines, members.run)
    (here.tmp / "etc").mkdir()
    (here.tmp / "checkpoints" / "proj").mkdir(parents=True)
    shutil.copy(SCRIPT, here.tmp / "checkpoints" / "proj" / "train.py")
    # the operator hands the user the submit token and the API's CA (step 7's prose)
    cluster = Cluster(here)
    user_dir = here.home / ".lazarus"
    shell_env: dict[str, str] = {}
    cwd: Path | None = None
    run: Lines | None = None
    seen: dict[str, subprocess.CompletedProcess] = {}
    try:
        for line in lines:
            if line.startswith(INSTALL) or line in etcd_lines:
                continue
            if line.startswith("cd "):
                cwd = Path(here(line.split(None, 1)[1]))
            elif line.startswith("export "):
                shell_env = exported(here.on_node(line, 2))  # step 8's shell is on node-2
            elif not line.startswith("lazarus "):
                done = subprocess.run(["bash", "-c", here(line)], capture_output=True,
                                      text=True, timeout=60)
                assert done.returncode == 0, (line, done.stderr)
            elif line.startswith("lazarus daemon "):
                for n in (1, 2):
                    cluster.start(f"etcd-{n}", here(line.replace("0.0.0.0", f"etcd-{n}.example")))
            elif line.startswith("lazarus agent "):
                assert "--node node-1 --host 10.0.0.21 " in line and "--role active" in line
                for n in NODES:
                    on_n = line.replace("node-1", f"node-{n}").replace("10.0.0.21", f"10.0.0.2{n}")
                    if n == 3:
                        on_n = on_n.replace("--role active", "--role spare")
                    cluster.start(f"node-{n}", here.on_node(on_n, n))
            elif line.startswith("lazarus run "):
                user_dir.mkdir(parents=True)
                shutil.copy(here.tmp / "etc" / "submit-token", user_dir / "submit-token")
                shutil.copy(here.tmp / "etc" / "api" / "ca.pem", user_dir / "api-ca.pem")
                proc = subprocess.Popen(_argv(here.on_node(line, 1)), cwd=cwd,
                                        env=cluster.env("user"), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        preexec_fn=die_with_parent)
                cluster.procs["user's lazarus run"] = proc
                run = Lines(proc)
            elif line.startswith("lazarus nodes "):
                def three_nodes():
                    out = lazarus(here(line), cluster.env("operator"))
                    rows = {row.split()[0]: row.split() for row in out.stdout.splitlines()
                            if row.startswith("node-")}
                    ready = (out.returncode == 0 and rows.keys() == {"node-1", "node-2", "node-3"}
                             and rows["node-3"][1:3] == ["spare", "spare"])
                    return out if ready else None
                seen["nodes"] = cluster.wait_for("three nodes listed, node-3 a spare",
                                                 three_nodes)
            elif line.startswith("lazarus chaos "):
                # the operator strikes once the run trains: node-2's rank prints its epochs
                cluster.wait_for("node-2's rank training",
                                 lambda: _rank_running(here.tmp / "node-2") or None)
                seen["chaos"] = lazarus(here.on_node(line, 2), {**cluster.env("node-2"),
                                                                 **shell_env})
                assert seen["chaos"].returncode == 0, seen["chaos"].stderr
            elif line.startswith("lazarus events "):
                def recovered():
                    out = lazarus(here(line), cluster.env("operator"))
                    return out if re.search(r"^\S+\s+recovered\s", out.stdout, re.M) else None
                seen["events"] = cluster.wait_for("a recovery in the events", recovered)
            elif line.startswith("lazarus status "):
                # the daemons serve once they have started: the operator asks again until then
                def answered():
                    out = lazarus(here(line), cluster.env("operator"))
                    assert out.returncode in (0, 3), out.stderr
                    return out if out.returncode == 0 else None
                seen["status"] = cluster.wait_for("a daemon answering", answered)
            else:
                command = line.split()[1]
                seen[command] = lazarus(here(line), cluster.env(
                    "user" if "~/" in line else "operator"), cwd=cwd)
        assert run is not None, "the walk-through runs no `lazarus run`"
        printed = run.rest()
        status = lazarus(here(the(lines, "lazarus status")[0]), cluster.env("operator"))
    finally:
        cluster.stop()
    # the user's run: SUCCEEDED after a recovery, exit 0
    assert run.proc.returncode == 0, (printed, run.proc.stderr.read())
    assert printed[-1].startswith("SUCCEEDED: job 'train.py' ("), printed
    assert any("[recovered]" in p for p in printed), printed
    assert "SUCCEEDED" in status.stdout, status.stdout
    # what the operator saw: three nodes, the fault struck, the recovery in the events
    assert "killed pid" in seen["chaos"].stdout, seen["chaos"].stdout
    assert re.search(r"fault_detected\s+worker crash on node-2", seen["events"].stdout), \
        seen["events"].stdout
    assert "answered" in seen["status"].stdout, seen["status"].stdout
    # the submit token runs jobs and cannot drain a node
    assert seen["drain"].returncode == 4, seen["drain"]
    assert "DrainNode needs the admin token" in seen["drain"].stderr, seen["drain"].stderr


def test_three_members_started_from_the_docs_lines_keep_a_quorum_over_tls(members):
    here, lines, procs, tmp_path = members.here, members.lines, members.procs, members.here.tmp
    for n in MEMBERS:
        for name in ("server.pem", "server-key.pem", "peer.pem", "peer-key.pem"):
            assert (here.pki / f"127.0.0.{n}" / name).is_file(), members.certs.stdout
    clients: list[E.Etcd] = []

    def client(endpoint: str, auth: EtcdAuth) -> E.Etcd:
        clients.append(E.Etcd(endpoint, auth=auth))
        return clients[-1]

    try:
        env = exported(here(the(lines, "export LAZARUS_ETCD=")[0]))
        documented = EtcdAuth.load(env=env)
        assert E.parse_endpoints(env["LAZARUS_ETCD"]) == [here.endpoint(n) for n in MEMBERS]

        client(here.endpoint(1), documented).put(KEY, b"through member 1")
        assert client(here.endpoint(3), documented).get(KEY).value == b"through member 1"

        procs[1].send_signal(signal.SIGKILL)
        procs.pop(1).wait(timeout=10)
        # the docs' client names member 1 first: its calls go on to the others
        all_three = client(env["LAZARUS_ETCD"], documented)
        until("a write after member 1 died", lambda: all_three.put(KEY, b"two of three"),
              procs, tmp_path)
        client(here.endpoint(2), documented).put(KEY, b"through member 2")
        assert client(here.endpoint(3), documented).get(KEY).value == b"through member 2"

        # TLS, a user and a password, but no client certificate: the member refuses
        no_cert = EtcdAuth.load(ca=env["LAZARUS_ETCD_CA"], user=env["LAZARUS_ETCD_USER"],
                                password_file=env["LAZARUS_ETCD_PASSWORD_FILE"], env={})
        try:
            client(here.endpoint(2), no_cert).get(KEY)
        except E.EtcdTLSError as e:
            assert "client certificate" in str(e), e
        else:
            raise AssertionError("a client without a certificate was served")
    finally:
        for c in clients:
            c.close()
