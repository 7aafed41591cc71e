"""A private certificate authority for one etcd cluster: the CA, the members' server
certificates and the clients' certificates, as PEM files.

`lazarus up` and the embedded etcd's secure mode make one at start; an operator without a
PKI of their own can make one the same way (docs/operations.md, "Securing etcd"). Keys are
ECDSA P-256 (small and fast on a 2-core machine); certificates last a year by default.
Private keys are written readable by their owner only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DAYS = 365


@dataclass(frozen=True, slots=True)
class CertFiles:
    """A certificate and its key on disk, and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """`path` replaced by a new file holding `data`. Written under a fresh name (O_EXCL, 0600:
    nothing planted there is opened, a key is never readable by others even for a moment) and
    renamed over `path`: a symlink planted at `path` is replaced, not written through, and an
    old key file's looser mode does not carry over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if not private:
                os.fchmod(f.fileno(), 0o644)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class CertAuthority:
    """A CA kept in `directory` (ca.pem, ca-key.pem); `issue` signs certificates with it."""

    def __init__(self, directory: Path, *, name: str = "lazarus etcd CA", days: int = DAYS):
        self.directory = Path(directory)
        self.ca_file = self.directory / "ca.pem"
        self.days = days
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder()
                      .subject_name(_name(name)).issuer_name(_name(name))
                      .public_key(self._key.public_key())
                      .serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5))
                      .not_valid_after(now + datetime.timedelta(days=days))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(
                          digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        _write(self.ca_file, self._cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(self.directory / "ca-key.pem", _key_pem(self._key), private=True)

    def issue(self, name: str, *, server: bool = False, client: bool = True,
              hosts: tuple[str, ...] = ()) -> CertFiles:
        """`name`.pem and `name`-key.pem in the CA's directory. `hosts` (IP addresses or DNS
        names) are what a server certificate is valid for; the common name is `name`, which
        etcd takes as the user of a client that presents no password."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        builder = (x509.CertificateBuilder()
                   .subject_name(_name(name)).issuer_name(self._cert.subject)
                   .public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=self.days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [_san(h) for h in hosts]), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        files = CertFiles(cert=self.directory / f"{name}.pem",
                          key=self.directory / f"{name}-key.pem", ca=self.ca_file)
        _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(files.key, _key_pem(key), private=True)
        return files


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
