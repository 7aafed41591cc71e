"""docs/operations.md's three-member etcd ("Securing etcd", "A three-member etcd with TLS") run
as written on one machine: the certificates from its `lazarus etcd certs --hosts ...` line, the
three members from its `etcd --name ...` lines, authentication from its `lazarus etcd
enable-auth` line, and a client from its `export LAZARUS_ETCD...` line. The lines are taken
from the docs' fenced blocks (continuations joined, comments dropped); the etcd lines run
under bash, as an operator's shell runs them.

One machine is not three hosts, so the text is changed in these ways and no other:
- `etcd-N.example` -> 127.0.0.N: Linux routes all of 127/8 to loopback, so these are three
  addresses without /etc/hosts; in member N's line, `0.0.0.0` -> 127.0.0.N too, since three
  members cannot all listen on every address;
- the ports 2379 and 2380 -> two free ports (the same on all three addresses);
- /etc/lazarus/pki and /etc/lazarus/etcd -> the test's pki directory, /var/lib/etcd -> a data
  directory per member.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import die_with_parent, free_port
from lazarus.core.etcd_auth import EtcdAuth

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
MEMBERS = (1, 2, 3)
START_S = 20  # a hang guard: three members on loopback elect a leader in about a second
KEY = "/lazarus/v1/test/three-members"  # under the root, where lazarus-daemon may write


def documented_lines() -> list[str]:
    """The commands of the fenced blocks of the "Securing etcd" section."""
    section = DOCS.read_text().split("\n## Securing etcd\n", 1)[1].split("\n## ", 1)[0]
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
    assert found, f"docs/operations.md, 'Securing etcd': no line starting {start!r}"
    return found


class Here:
    """The substitutions of the module docstring."""

    def __init__(self, tmp: Path):
        self.tmp, self.pki = tmp, tmp / "pki"
        self.client_port, self.peer_port = free_port(), free_port()

    def __call__(self, text: str, member: int | None = None) -> str:
        for n in MEMBERS:
            text = text.replace(f"etcd-{n}.example", f"127.0.0.{n}")
        if member is not None:
            text = (text.replace("0.0.0.0", f"127.0.0.{member}")
                    .replace("/var/lib/etcd", str(self.tmp / f"data-{member}")))
        text = text.replace(":2379", f":{self.client_port}").replace(":2380", f":{self.peer_port}")
        return text.replace("/etc/lazarus/pki", str(self.pki)).replace("/etc/lazarus/etcd",
                                                                      str(self.pki))

    def endpoint(self, member: int) -> str:
        return f"127.0.0.{member}:{self.client_port}"


def lazarus(line: str) -> subprocess.CompletedProcess:
    """A documented `lazarus ...` line, run by this interpreter's lazarus.cli."""
    argv = shlex.split(line)
    assert argv[0] == "lazarus", line
    return subprocess.run([sys.executable, "-m", "lazarus.cli", *argv[1:]], capture_output=True,
                          text=True, timeout=60)


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


def test_three_members_started_from_the_docs_lines_keep_a_quorum_over_tls(tmp_path):
    lines = documented_lines()
    here = Here(tmp_path)
    certs_line, = [line for line in the(lines, "lazarus etcd certs") if "--hosts" in line]
    certs = lazarus(here(certs_line))
    assert certs.returncode == 0, certs.stderr
    for n in MEMBERS:
        for name in ("server.pem", "server-key.pem", "peer.pem", "peer-key.pem"):
            assert (here.pki / f"127.0.0.{n}" / name).is_file(), certs.stdout
    members = the(lines, "etcd --name")
    assert len(members) == 3, members
    cert_only = EtcdAuth.load(ca=str(here.pki / "ca.pem"), cert=str(here.pki / "client.pem"),
                              key=str(here.pki / "client-key.pem"), env={})
    procs: dict[int, subprocess.Popen] = {}
    clients: list[E.Etcd] = []

    def client(endpoint: str, auth: EtcdAuth) -> E.Etcd:
        clients.append(E.Etcd(endpoint, auth=auth))
        return clients[-1]

    try:
        for n, line in zip(MEMBERS, members):
            assert f"--name etcd-{n} " in line, line
            with open(tmp_path / f"etcd-{n}.log", "wb") as log:
                procs[n] = subprocess.Popen(["bash", "-c", "exec " + here(line, n)],
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        for n in MEMBERS:  # a linearizable read: the member serves, with a quorum behind it
            member = client(here.endpoint(n), cert_only)
            until(f"member {n} serving", lambda: member.get(KEY), procs, tmp_path)

        enable = lazarus(here(the(lines, "lazarus etcd enable-auth")[0]))
        assert enable.returncode == 0, enable.stderr
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
        for proc in procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
