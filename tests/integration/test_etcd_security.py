"""etcd in secure mode (TLS with client certificates, authentication, our roles), as `lazarus
up` runs it: who can read and write our keys, and what a refused client is told."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from lazarus import cli
from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.etcd_rbac import AGENT_USER, DAEMON_USER
from lazarus.core.records import Keys

KEYS = Keys()
JOB = b'{"the": "job"}'


@pytest.fixture(scope="module")
def server():
    with EmbeddedEtcd(secure=True) as server:
        daemon = E.Etcd(server.endpoint, auth=server.auth(DAEMON_USER))
        E.retry(lambda: daemon.put(KEYS.job, JOB), deadline_s=30)
        daemon.close()
        yield server


@pytest.fixture
def daemon(server):
    client = E.Etcd(server.endpoint, auth=server.auth(DAEMON_USER))
    yield client
    client.close()


def _raw(channel: grpc.Channel, metadata=()) -> list[str]:
    """An attacker's read and write of our keys through etcd's gRPC API, no client of ours
    in between: the errors etcd answered (none when it served them)."""
    kv = rpc.KVStub(channel)
    errors = []
    for call, req in ((kv.Range, rpc.RangeRequest(key=KEYS.job.encode())),
                      (kv.Put, rpc.PutRequest(key=KEYS.job.encode(), value=b"evil")),
                      (kv.Put, rpc.PutRequest(key=KEYS.status.encode(), value=b"evil"))):
        try:
            call(req, timeout=3, metadata=metadata)
        except grpc.RpcError as e:
            errors.append(e.code().name)
    channel.close()
    return errors


def test_network_access_alone_neither_reads_nor_writes_our_keys(server, daemon):
    target = server.endpoint
    security = server.security
    # plaintext: the TLS-only listener closes the connection
    assert _raw(grpc.insecure_channel(target)) == ["UNAVAILABLE"] * 3
    # TLS trusting etcd's CA (a public certificate), but no client certificate
    no_cert = grpc.ssl_channel_credentials(security.ca.ca_file.read_bytes())
    assert _raw(grpc.secure_channel(target, no_cert)) == ["UNAVAILABLE"] * 3
    # a stolen client certificate but no password: authenticated as nobody
    with_cert = grpc.ssl_channel_credentials(security.ca.ca_file.read_bytes(),
                                             security.client.key.read_bytes(),
                                             security.client.cert.read_bytes())
    assert _raw(grpc.secure_channel(target, with_cert)) == ["PERMISSION_DENIED"] * 3
    # ... or a password guessed wrong
    auth = rpc.AuthStub(grpc.secure_channel(target, with_cert))
    with pytest.raises(grpc.RpcError, match="authentication failed"):
        auth.Authenticate(rpc.AuthenticateRequest(name="root", password="root"), timeout=3)
    assert daemon.get(KEYS.job).value == JOB and daemon.get(KEYS.status) is None


def test_an_agent_writes_only_what_agents_write(server, daemon):
    agent = E.Etcd(server.endpoint, auth=server.auth(AGENT_USER))
    try:
        assert agent.get(KEYS.job).value == JOB  # it reads everything under the root
        agent.put(KEYS.node_key("n0"), b"{}")
        agent.put(KEYS.nodestatus_key("n0"), b"{}")
        for key in (KEYS.job, KEYS.status, KEYS.round, KEYS.leader, KEYS.round_key(7),
                    KEYS.pause, KEYS.cordon_key("n1"), KEYS.accepted_job):
            with pytest.raises(E.EtcdPermissionDenied,
                               match=f"etcd user '{AGENT_USER}' has no right to it"):
                agent.put(key, b"evil")
            with pytest.raises(E.EtcdPermissionDenied):
                agent.txn([], [E.put_op(key, b"evil")])
        with pytest.raises(E.EtcdPermissionDenied):
            agent.delete(KEYS.root, prefix=True)
        with pytest.raises(E.EtcdPermissionDenied):  # nor anything outside our root
            agent.put("/elsewhere", b"x")
    finally:
        agent.close()
    assert daemon.get(KEYS.job).value == JOB and daemon.get(KEYS.status) is None


def _submit(server, tmp_path, capsys, *flags: str) -> tuple[int, list[str]]:
    job = tmp_path / "job.toml"
    job.write_text("[job]\nnodes = 1\n")
    code = cli.main(["submit", str(job), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_refused_clients_are_told_why_in_one_line(server, daemon, tmp_path, capsys):
    security = server.security
    ca, cert, key = map(str, (security.ca.ca_file, security.client.cert, security.client.key))
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    wrong.chmod(0o600)  # a secret file others may read is refused before etcd sees it
    right = str(security.password_files[DAEMON_USER])
    ep = server.endpoint
    cases = [
        # wrong password
        (["--etcd", ep, "--etcd-ca", ca, "--etcd-cert", cert, "--etcd-key", key,
          "--etcd-user", DAEMON_USER, "--etcd-password-file", str(wrong)],
         f"refused user '{DAEMON_USER}': wrong user name or password"),
        # no CA: https needs one; plaintext to a TLS etcd is closed on
        (["--etcd", f"https://{ep}"], "is https but no --etcd-ca was given"),
        (["--etcd", ep], "(if it serves TLS, give --etcd-ca)"),
        # no client certificate
        (["--etcd", ep, "--etcd-ca", ca, "--etcd-user", DAEMON_USER,
          "--etcd-password-file", right], "it asks for a client certificate"),
        # a certificate file that is not there
        (["--etcd", ep, "--etcd-ca", ca, "--etcd-cert", str(tmp_path / "gone.pem"),
          "--etcd-key", key], f"--etcd-cert {tmp_path / 'gone.pem'}: cannot read it"),
        # no user at all
        (["--etcd", ep, "--etcd-ca", ca, "--etcd-cert", cert, "--etcd-key", key],
         "no --etcd-user was given and etcd requires one"),
    ]
    for flags, expect in cases:
        code, err = _submit(server, tmp_path, capsys, *flags)
        ours = [line for line in err if line.startswith("lazarus submit: error:")]
        assert code != 0 and len(ours) == 1 and expect in ours[0], (flags, err)
        assert not any("Traceback" in line for line in err)
    code, _ = _submit(server, tmp_path, capsys, "--etcd", ep, "--etcd-ca", ca, "--etcd-cert",
                      cert, "--etcd-key", key, "--etcd-user", DAEMON_USER,
                      "--etcd-password-file", right)
    assert code == 0 and daemon.get(KEYS.job).value != JOB
    daemon.put(KEYS.job, JOB)


def test_an_agent_with_a_wrong_password_says_so_before_it_starts_workers(server, tmp_path):
    """The refusal comes from the agent's first read, before its zygote imports torch and its
    workers park: no worker log is made and nothing is left running."""
    security = server.security
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    wrong.chmod(0o600)
    workdir = tmp_path / "work"
    agent = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "agent", "--etcd", server.endpoint,
         "--etcd-ca", str(security.ca.ca_file), "--etcd-cert", str(security.client.cert),
         "--etcd-key", str(security.client.key), "--etcd-user", AGENT_USER,
         "--etcd-password-file", str(wrong), "--node", "n9", "--workdir", str(workdir),
         "--gpu-backend", "sim"],
        capture_output=True, text=True, timeout=120)
    err = agent.stderr.strip().splitlines()
    assert agent.returncode != 0 and "Traceback" not in agent.stderr, agent.stderr
    assert err and f"refused user '{AGENT_USER}': wrong user name or password" in err[-1], err
    assert not (workdir / "logs").exists(), sorted(p.name for p in workdir.rglob("*"))


def test_a_client_whose_token_etcd_forgot_authenticates_again(server, daemon):
    """etcd forgets tokens when they idle past --auth-token-ttl or their user's password is
    set (here: to the same one); calls and watches then go on with a new token."""
    seen = threading.Event()
    key = KEYS.event_key("token-test")
    watch = daemon.watch_prefix(KEYS.events, start_revision=daemon.revision(KEYS.root) + 1,
                                on_events=lambda evs: any(e.kv.key == key for e in evs)
                                and seen.set())
    token = dict(daemon._client.metadata)["token"]
    root = E.Etcd(server.endpoint, auth=server.auth("root"))
    try:
        root.auth_call("UserChangePassword", rpc.AuthUserChangePasswordRequest(
            name=DAEMON_USER, password=server.security.password_files[DAEMON_USER].read_text()))
        channel = grpc.secure_channel(server.endpoint, grpc.ssl_channel_credentials(
            server.security.ca.ca_file.read_bytes(), server.security.client.key.read_bytes(),
            server.security.client.cert.read_bytes()))
        with pytest.raises(grpc.RpcError, match="invalid auth token"):
            rpc.KVStub(channel).Range(rpc.RangeRequest(key=KEYS.job.encode()), timeout=3,
                                      metadata=(("token", token),))
        channel.close()
        E.retry(lambda: daemon.put(key, b"{}"), deadline_s=30)  # a busy machine is slow
        assert dict(daemon._client.metadata)["token"] != token
        assert seen.wait(15), "the watch did not go on with a new token"
    finally:
        watch.cancel()
        root.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lazarus.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_a_refused_certificate_is_one_line_from_the_command(server, tmp_path):
    """gRPC's own log lines of a failed handshake stay out of the command's output."""
    job = tmp_path / "job.toml"
    job.write_text("[job]\nnodes = 1\n")
    security = server.security
    proc = _cli("submit", str(job), "--etcd", server.endpoint, "--etcd-ca",
                str(security.ca.ca_file), "--etcd-user", DAEMON_USER, "--etcd-password-file",
                str(security.password_files[DAEMON_USER]))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "it asks for a client certificate signed by the CA it trusts" in lines[0]


def test_preflight_compares_the_clock_with_a_secure_etcds_leader(server, tmp_path):
    """`lazarus preflight --etcd ... --etcd-ca ...` as docs/operations.md has it: the clock
    check reaches the leader over TLS, signed in as the user it is given."""
    security = server.security
    proc = _cli("preflight", "--etcd", server.endpoint, "--etcd-ca", str(security.ca.ca_file),
                "--etcd-cert", str(security.client.cert), "--etcd-key", str(security.client.key),
                "--etcd-user", AGENT_USER, "--etcd-password-file",
                str(security.password_files[AGENT_USER]), "--workdir", str(tmp_path),
                "--skip", "gpu,storage,checkpoint,collective", "--json")
    assert proc.returncode == 0, proc.stderr
    (clock,) = [c for c in json.loads(proc.stdout)["checks"] if not c["skipped"]]
    assert clock["name"] == "clock" and clock["ok"] and "etcd leader" in clock["reason"], clock


def test_plaintext_off_loopback_is_refused_without_insecure(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("[job]\nnodes = 1\n")
    etcd = _cli("submit", str(job), "--etcd", "192.0.2.1:2379")
    assert etcd.returncode == 2 and etcd.stderr.strip().splitlines() == [
        "lazarus submit: error: etcd at 192.0.2.1 is plaintext on non-loopback address "
        "192.0.2.1: anyone on the network could read and steer the cluster; give --etcd-ca "
        "(and a client certificate or user), or pass --insecure to accept that"]
    api = _cli("daemon", "--etcd", "127.0.0.1:9", "--api", "0.0.0.0:0")
    assert api.returncode == 2 and api.stderr.strip().splitlines() == [
        "lazarus daemon: error: --api 0.0.0.0:0 is plaintext on non-loopback address 0.0.0.0: "
        "anyone on the network could read and steer the cluster; give --tls-cert and "
        "--tls-key, or pass --insecure to accept that"]


def test_an_agent_takes_plaintext_off_loopback_only_with_insecure(etcd, keys, tmp_path):
    """0.0.0.0 dials this host's etcd, but is no loopback address: refused, unless the
    operator says --insecure; then the agent registers under its --root."""
    port = etcd.member.rpartition(":")[2]
    agent = ["agent", "--etcd", f"0.0.0.0:{port}", "--root", keys.root, "--node", "plain",
             "--workdir", str(tmp_path / "w"), "--gpu-backend", "sim", "--tier0", "off",
             "--preflight", "off", "--no-park"]
    refused = _cli(*agent)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "lazarus agent: error: etcd at 0.0.0.0 is plaintext on non-loopback address 0.0.0.0: "
        "anyone on the network could read and steer the cluster; give --etcd-ca (and a client "
        "certificate or user), or pass --insecure to accept that"]
    proc = subprocess.Popen([sys.executable, "-m", "lazarus.cli", *agent, "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60  # a hang guard, not a timing
        while etcd.get(keys.node_key("plain")) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_enable_auth_again_sets_the_passwords_of_the_files(tmp_path, capsys):
    """`lazarus etcd enable-auth` on an etcd whose authentication is on already: it signs in
    as root and sets the users' passwords to those of --passwords DIR."""
    with EmbeddedEtcd(tmp_path / "etcd", secure=True) as server:
        security = server.security
        for user, path in security.password_files.items():
            if user != AGENT_USER:
                (tmp_path / path.name).write_text(path.read_text())
        # `lazarus etcd passwords DIR` makes the missing one (a new agent password), keeps
        # the others
        assert cli.main(["etcd", "passwords", str(tmp_path)]) == 0
        made = [Path(p) for p in capsys.readouterr().out.split()]
        assert sorted(p.name for p in made) == sorted(
            f"{u}.password" for u in security.password_files)
        agent_password = (tmp_path / f"{AGENT_USER}.password").read_text()
        assert (tmp_path / f"{AGENT_USER}.password").stat().st_mode & 0o777 == 0o600
        for user, path in security.password_files.items():
            assert (user == AGENT_USER) != ((tmp_path / path.name).read_text()
                                            == path.read_text())
        code = cli.main(["etcd", "enable-auth", "--etcd", server.endpoint,
                         "--etcd-ca", str(security.ca.ca_file), "--etcd-cert",
                         str(security.client.cert), "--etcd-key", str(security.client.key),
                         "--passwords", str(tmp_path)])
        assert code == 0 and "etcd authentication updated" in capsys.readouterr().out
        old = E.Etcd(server.endpoint, auth=server.auth(AGENT_USER))
        new = E.Etcd(server.endpoint, auth=dataclasses.replace(
            server.auth(AGENT_USER), password=agent_password))
        try:
            with pytest.raises(E.EtcdAuthFailed):
                old.get(KEYS.job)
            assert new.get(KEYS.job) is None
        finally:
            old.close()
            new.close()


def test_with_insecure_the_daemon_serves_its_api_in_plaintext_off_loopback(server, tmp_path):
    """--insecure is the operator's explicit yes: the daemon starts, on every address."""
    token = tmp_path / "token"
    token.write_text("t0ken-0123456789abcdef")
    token.chmod(0o600)  # a token file others may read is refused
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "lazarus.cli", "daemon", "--etcd", server.endpoint,
             *server.auth(DAEMON_USER).args(), "--api", "0.0.0.0:0", "--insecure",
             "--token-file", str(token), "--endpoint-file", "", "--data-dir",
             str(tmp_path / "data"), "--root", "/test/insecure-api/"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60  # a hang guard, not a timing
        while "API on" not in log.read_text():
            assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
