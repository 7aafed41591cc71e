"""What an etcd client is given to reach etcd securely: each mistake is one clear line before
anything connects, and plaintext leaves loopback only with --insecure."""

from __future__ import annotations

import pytest

from lazarus.core.certs import CertAuthority
from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import PASSWORD_ENV, EtcdAuth, is_loopback


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CertAuthority(tmp_path_factory.mktemp("pki"))
    return ca, ca.issue("client")


def test_files_and_password_are_read_and_passed_on_to_children(pki, tmp_path):
    ca, client = pki
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)  # a secret file others may read is refused
    auth = EtcdAuth.load(ca=str(ca.ca_file), cert=str(client.cert), key=str(client.key),
                         user="lazarus-agent", password_file=str(secret), env={})
    assert auth.tls and auth.password == "s3cret" and auth.ca.startswith(b"-----BEGIN")
    assert "s3cret" not in repr(auth)
    args = auth.args()
    flags = dict(zip(args[::2], args[1::2]))
    again = EtcdAuth.load(ca=flags["--etcd-ca"], cert=flags["--etcd-cert"],
                          key=flags["--etcd-key"], user=flags["--etcd-user"],
                          password_file=flags["--etcd-password-file"], env={})
    assert again == auth


def test_environment_gives_what_flags_do_not(pki):
    ca, _ = pki
    auth = EtcdAuth.load(env={"LAZARUS_ETCD_CA": str(ca.ca_file), "LAZARUS_ETCD_USER": "u",
                              PASSWORD_ENV: "from-env"})
    assert auth.tls and (auth.user, auth.password) == ("u", "from-env")


@pytest.mark.parametrize("given, expect", [
    (dict(ca="/no/such/ca.pem"), "--etcd-ca /no/such/ca.pem: cannot read it (No such file"),
    (dict(ca="CA", cert="/no/such/cert.pem", key="KEY"), "--etcd-cert /no/such/cert.pem: cannot"),
    (dict(ca="CA", cert="CERT"), "needs both --etcd-cert and --etcd-key"),
    (dict(cert="CERT", key="KEY"), "--etcd-cert needs --etcd-ca"),
    (dict(ca="KEY"), "--etcd-ca KEY: not a PEM file holding a certificate"),
    (dict(ca="CA", cert="CERT", key="CERT"), "not a PEM file holding a private key"),
    (dict(user="lazarus-agent"), "--etcd-user lazarus-agent needs its password"),
    (dict(password_file="PW"), "no --etcd-user"),
    (dict(user="u", password_file="/no/such/pw"), "--etcd-password-file /no/such/pw: cannot"),
    (dict(user="u", password_file="EMPTY"), "is empty"),
])
def test_a_mistake_is_one_clear_line(pki, tmp_path, given, expect):
    ca, client = pki
    (tmp_path / "pw").write_text("x")
    (tmp_path / "empty").write_text("\n")
    for name in ("pw", "empty"):
        (tmp_path / name).chmod(0o600)  # a secret file others may read is refused
    files = {"CA": str(ca.ca_file), "CERT": str(client.cert), "KEY": str(client.key),
             "PW": str(tmp_path / "pw"), "EMPTY": str(tmp_path / "empty")}
    with pytest.raises(UserError) as e:
        EtcdAuth.load(**{k: files.get(v, v) for k, v in given.items()}, env={})
    assert expect.replace("KEY", files["KEY"]) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("10.0.0.5", False), ("0.0.0.0", False), ("", False),
    ("etcd.example.com", False), ("localhost.evil.com", False),
])
def test_loopback_is_only_a_literal_loopback_address(host, loopback):
    assert is_loopback(host) is loopback


def test_plaintext_off_loopback_needs_insecure(pki):
    ca, _ = pki
    with pytest.raises(UserError, match=r"etcd at 10\.0\.0\.5 is plaintext on non-loopback "
                                        r"address 10\.0\.0\.5: .*give --etcd-ca.*--insecure"):
        EtcdAuth().check("10.0.0.5:2379", ["10.0.0.5"])
    EtcdAuth().check("127.0.0.1:2379", ["127.0.0.1"])
    EtcdAuth(insecure=True).check("10.0.0.5:2379", ["10.0.0.5"])
    EtcdAuth.load(ca=str(ca.ca_file), env={}).check("10.0.0.5:2379", ["10.0.0.5"])


def test_https_needs_a_ca_and_http_refuses_one(pki):
    ca, _ = pki
    with pytest.raises(UserError, match="is https but no --etcd-ca was given"):
        EtcdAuth(insecure=True).check("https://10.0.0.5:2379", ["10.0.0.5"])
    with pytest.raises(UserError, match="names http:// but --etcd-ca asks for TLS"):
        EtcdAuth.load(ca=str(ca.ca_file), env={}).check("http://127.0.0.1:2379", ["127.0.0.1"])
