"""`lazarus etcd certs DIR --hosts ...`: per member a server and a peer certificate with the
usages and names etcd checks, a client certificate, all signed by one CA; run again, it adds
what is missing with that CA and never replaces a file; a mistake is one line."""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID as EKU

from lazarus.core.certs import CertAuthority
from lazarus.core.errors import UserError
from lazarus.ops.etcdsetup import main

BOTH = {EKU.SERVER_AUTH, EKU.CLIENT_AUTH}


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _usages(cert: x509.Certificate) -> set:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def _names(cert: x509.Certificate) -> set[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ({str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
            | set(san.get_values_for_type(x509.DNSName)))


def _files(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_each_member_gets_a_server_and_a_peer_certificate_signed_by_the_ca(tmp_path, capsys):
    pki = tmp_path / "pki"
    assert main(["certs", str(pki), "--hosts", "etcd-1.example,10.0.0.12"]) == 0
    out = capsys.readouterr().out
    ca = _cert(pki / "ca.pem")
    for member in ("etcd-1.example", "10.0.0.12"):
        for name in ("peer", "server"):
            cert = _cert(pki / member / f"{name}.pem")
            cert.verify_directly_issued_by(ca)
            # a peer serves its peer port and dials the others'; a server certificate is
            # presented by etcd's own gateway to its client port too
            assert _usages(cert) == BOTH, (member, name)
            assert _names(cert) == {member, "127.0.0.1", "localhost"}, (member, name)
            assert f"made  {pki / member / f'{name}.pem'}" in out
            key = pki / member / f"{name}-key.pem"
            assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    san = _cert(pki / "10.0.0.12" / "peer.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.0.0.12") in san.get_values_for_type(x509.IPAddress)
    client = _cert(pki / "client.pem")
    client.verify_directly_issued_by(ca)
    assert _usages(client) == {EKU.CLIENT_AUTH}
    assert stat.S_IMODE(os.stat(pki / "ca-key.pem").st_mode) == 0o600
    assert not (pki / "server.pem").exists()  # that is --host's shared certificate


def test_a_new_member_is_added_with_the_same_ca_and_old_files_are_kept_byte_for_byte(
        tmp_path, capsys):
    pki = tmp_path / "pki"
    main(["certs", str(pki), "--hosts", "etcd-1.example,etcd-2.example"])
    before = _files(pki)
    capsys.readouterr()
    assert main(["certs", str(pki), "--hosts", "etcd-1.example", "--hosts",
                 "etcd-3.example"]) == 0
    out = capsys.readouterr().out
    after = _files(pki)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {f"etcd-3.example/{n}" for n in (
        "server.pem", "server-key.pem", "peer.pem", "peer-key.pem")}
    _cert(pki / "etcd-3.example" / "peer.pem").verify_directly_issued_by(_cert(pki / "ca.pem"))
    assert f"kept  {pki / 'ca.pem'}" in out
    assert f"kept  {pki / 'etcd-1.example' / 'peer.pem'}" in out
    assert f"made  {pki / 'etcd-3.example' / 'peer.pem'}" in out


def test_the_shared_server_certificate_of_host_still_covers_its_hosts_and_loopback(tmp_path):
    pki = tmp_path / "pki"
    main(["certs", str(pki), "--host", "etcd.lazarus.svc", "--host", "*.etcd-peer.lazarus.svc"])
    server = _cert(pki / "server.pem")
    assert _usages(server) == BOTH
    assert _names(server) == {"etcd.lazarus.svc", "*.etcd-peer.lazarus.svc", "127.0.0.1",
                              "localhost"}
    assert main(["certs", str(pki), "--host", "etcd.lazarus.svc"]) == 0  # kept: it covers it
    with pytest.raises(UserError, match="server.pem is kept .* not valid for etcd.other"):
        main(["certs", str(pki), "--host", "etcd.other"])


@pytest.mark.parametrize("host", ["etcd_1:2379", "https://etcd-1.example", "etcd-1..example",
                                  "-etcd-1", "10.0.0.256", "", "etcd 1"])
def test_a_malformed_host_is_one_user_error(tmp_path, host):
    with pytest.raises(UserError, match="is not a host name or IP address") as e:
        main(["certs", str(tmp_path / "pki"), "--hosts", f"etcd-1.example,{host}"])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "pki").exists()  # checked before anything is made


def test_a_member_is_one_host_not_a_wildcard(tmp_path):
    with pytest.raises(UserError, match="is not a host name"):
        main(["certs", str(tmp_path), "--hosts", "*.peers.example"])


def test_a_directory_with_files_but_no_ca_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(UserError, match="holds files but no CA"):
        main(["certs", str(tmp_path), "--hosts", "etcd-1.example"])
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_ca_key_that_is_not_the_cas_is_refused_and_nothing_is_made(tmp_path):
    main(["certs", str(tmp_path), "--hosts", "etcd-1.example"])
    other = tmp_path / "other"
    CertAuthority(other)
    (tmp_path / "ca-key.pem").write_bytes((other / "ca-key.pem").read_bytes())
    with pytest.raises(UserError, match="ca-key.pem is not the key of .*ca.pem"):
        main(["certs", str(tmp_path), "--hosts", "etcd-2.example"])
    assert not (tmp_path / "etcd-2.example").exists()


def test_a_certificate_without_its_key_is_refused_not_replaced(tmp_path):
    main(["certs", str(tmp_path), "--hosts", "etcd-1.example"])
    peer = (tmp_path / "etcd-1.example" / "peer.pem").read_bytes()
    (tmp_path / "etcd-1.example" / "peer-key.pem").unlink()
    with pytest.raises(UserError, match="peer.pem is there but not peer-key.pem"):
        main(["certs", str(tmp_path), "--hosts", "etcd-1.example"])
    assert (tmp_path / "etcd-1.example" / "peer.pem").read_bytes() == peer


def test_the_cli_says_a_bad_host_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "etcd", "certs",
                           str(tmp_path / "pki"), "--hosts", "etcd-1.example,etcd_2:2379"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("lazarus etcd: error: 'etcd_2:2379' is not a host name")


def test_the_ca_loads_only_with_its_own_key(tmp_path):
    ca = CertAuthority(tmp_path)
    assert isinstance(CertAuthority.load(tmp_path)._key, ec.EllipticCurvePrivateKey)
    (tmp_path / "ca-key.pem").unlink()
    with pytest.raises(ValueError, match="ca-key.pem: cannot read the CA's file"):
        CertAuthority.load(tmp_path)
    assert ca.ca_file.exists()
