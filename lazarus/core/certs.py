"""A private certificate authority for one etcd cluster: the CA, the members' server and peer
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
import re
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
    """A CA kept in `directory` (ca.pem, ca-key.pem); `issue` signs certificates with it.
    `CertAuthority(dir)` makes a new one there; `CertAuthority.load(dir)` takes the one there."""

    def __init__(self, directory: Path, *, name: str = "lazarus etcd CA", days: int = DAYS):
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(_name(name)).issuer_name(_name(name))
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, encipher_only=False,
                    decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        self._adopt(directory, days, key, cert)
        _write(self.ca_file, cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(self.key_file, _key_pem(key), private=True)

    @classmethod
    def load(cls, directory: Path, *, days: int = DAYS) -> "CertAuthority":
        """The CA in `directory`, to sign more certificates with. ValueError (one line) when
        its certificate or key cannot be read or the key is not the certificate's."""
        ca = cls.__new__(cls)
        directory = Path(directory)
        cert_file, key_file = directory / "ca.pem", directory / "ca-key.pem"
        try:
            cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
            key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        except OSError as e:
            raise ValueError(f"{e.filename}: cannot read the CA's file ({e.strerror})") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"{cert_file} or {key_file} is not a PEM certificate and "
                             f"unencrypted key ({e})") from None
        if key.public_key() != cert.public_key():
            raise ValueError(f"{key_file} is not the key of {cert_file}: put back the CA's "
                             "own key (certificates signed with another would not verify)")
        ca._adopt(directory, days, key, cert)
        return ca

    def _adopt(self, directory: Path, days: int, key, cert: x509.Certificate) -> None:
        self.directory = Path(directory)
        self.ca_file = self.directory / "ca.pem"
        self.key_file = self.directory / "ca-key.pem"
        self.days = days
        self._key, self._cert = key, cert

    def issue(self, name: str, *, server: bool = False, client: bool = True,
              hosts: tuple[str, ...] = (), stem: str | None = None) -> CertFiles:
        """`stem`.pem and `stem`-key.pem in the CA's directory (`stem` defaults to `name`;
        "etcd-1.example/peer" puts them in a subdirectory). `hosts` (IP addresses or DNS
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
        files = paths(self.directory, stem or name)
        _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(files.key, _key_pem(key), private=True)
        return files


def paths(directory: Path, stem: str) -> CertFiles:
    """Where `issue(..., stem=stem)` writes in `directory`."""
    directory = Path(directory)
    return CertFiles(cert=directory / f"{stem}.pem", key=directory / f"{stem}-key.pem",
                     ca=directory / "ca.pem")


def hosts_of(cert_file: Path) -> list[str]:
    """The names and addresses a certificate is valid for (its subject alternative names)."""
    cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return ([str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
            + names.get_values_for_type(x509.DNSName))


# A DNS label; "_" too, which some sites' host names carry and TLS clients match.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def check_host(host: str, *, wildcard: bool = False) -> str:
    """`host` if a certificate can name it: an IP address or a DNS name ("*.peers.example"
    too when `wildcard`); ValueError (one line) otherwise."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.split(".")
    if wildcard and len(labels) > 2 and labels[0] == "*":
        labels = labels[1:]
    # an all-digit last label is a mistyped address (10.0.0.256), not a name
    if (len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels)
            or labels[-1].isdigit()):
        raise ValueError(f"{host!r} is not a host name or IP address (give the name or address "
                         "clients dial, without scheme or port)")
    return host


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
