"""How a process of ours proves itself to etcd, and checks that it talks to the right etcd.

etcd is the trust boundary of Lazarus: whoever writes our keys steers the cluster. So a
client takes, besides the endpoint (docs/operations.md, "Securing etcd"):
- TLS: the CA that signed etcd's server certificate (--etcd-ca), and a client certificate
  and key (--etcd-cert, --etcd-key) when etcd asks clients for one (--client-cert-auth);
- etcd authentication: a user (--etcd-user) and its password, read from a file
  (--etcd-password-file) or the environment (LAZARUS_ETCD_PASSWORD); never a flag's value,
  which every user of the host can read in the process list.
Each flag also has an environment variable, so one `EnvironmentFile` or Kubernetes Secret
configures every process of a host.

Plaintext (no TLS) is only for loopback: a client refuses a non-loopback endpoint without
TLS unless the operator passed --insecure.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.core.errors import UserError
from lazarus.core.privatedir import read_secret_file

CA_ENV = "LAZARUS_ETCD_CA"
CERT_ENV = "LAZARUS_ETCD_CERT"
KEY_ENV = "LAZARUS_ETCD_KEY"
USER_ENV = "LAZARUS_ETCD_USER"
PASSWORD_FILE_ENV = "LAZARUS_ETCD_PASSWORD_FILE"
PASSWORD_ENV = "LAZARUS_ETCD_PASSWORD"

HTTPS, HTTP = "https://", "http://"


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and `localhost`: a name is not resolved, since what
    it resolves to can change after we checked."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_plaintext(what: str, host: str, *, insecure: bool, fix: str) -> None:
    """The one rule for every listener and client of ours: plaintext on a non-loopback
    address only with --insecure."""
    if not insecure and not is_loopback(host):
        raise UserError(f"{what} is plaintext on non-loopback address {host or '*'}: anyone "
                        f"on the network could read and steer the cluster; {fix}, or pass "
                        "--insecure to accept that")


def _read(path: str | Path, flag: str, *, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if marker not in data:
        raise UserError(f"{flag} {path}: not a PEM file holding a {marker.decode().lower()}")
    return data


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdAuth:
    """A client's TLS material (PEM bytes, read once at start: restart a process to give it
    renewed certificates) and etcd user. The default is plaintext with no user, which only
    loopback endpoints accept (unless `insecure`)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    insecure: bool = False
    # Where the material came from, for the flags of the processes we start (`args`).
    files: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return self.ca is not None

    @classmethod
    def load(cls, *, ca: str | None = None, cert: str | None = None, key: str | None = None,
             user: str | None = None, password_file: str | None = None,
             insecure: bool = False, env: dict[str, str] | None = None) -> "EtcdAuth":
        """From flags, each falling back to its environment variable. Every file is read and
        checked here: a missing or unreadable one is a one-line UserError at start, not a TLS
        failure later."""
        env = os.environ if env is None else env
        ca = ca or env.get(CA_ENV) or None
        cert = cert or env.get(CERT_ENV) or None
        key = key or env.get(KEY_ENV) or None
        user = user or env.get(USER_ENV) or None
        password_file = password_file or env.get(PASSWORD_FILE_ENV) or None
        if (cert is None) != (key is None):
            raise UserError("a client certificate needs both --etcd-cert and --etcd-key")
        if cert is not None and ca is None:
            raise UserError("--etcd-cert needs --etcd-ca: the CA that signed etcd's server "
                            "certificate")
        password = None
        if password_file is not None:
            try:
                password = read_secret_file(password_file, "--etcd-password-file",
                                            "a password").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"--etcd-password-file {password_file}: cannot read it "
                                f"({getattr(e, 'strerror', None) or e})") from None
            if not password:
                raise UserError(f"--etcd-password-file {password_file} is empty")
        elif env.get(PASSWORD_ENV):
            password = env[PASSWORD_ENV]
        if user is not None and password is None:
            raise UserError(f"--etcd-user {user} needs its password: --etcd-password-file FILE "
                            f"or the environment variable {PASSWORD_ENV}")
        if password is not None and user is None:
            raise UserError("an etcd password was given (--etcd-password-file or "
                            f"{PASSWORD_ENV}) but no --etcd-user")
        files = {k: v for k, v in (("ca", ca), ("cert", cert), ("key", key),
                                   ("password_file", password_file)) if v}
        return cls(ca=_read(ca, "--etcd-ca", marker=b"CERTIFICATE") if ca else None,
                   cert=_read(cert, "--etcd-cert", marker=b"CERTIFICATE") if cert else None,
                   key=_read(key, "--etcd-key", marker=b"PRIVATE KEY") if key else None,
                   user=user, password=password, insecure=insecure, files=files)

    def check(self, endpoint: str, hosts: list[str]) -> None:
        """Refuse what would be insecure or cannot work: an https:// endpoint without a CA,
        a plaintext one named http:// while TLS is configured, plaintext to a non-loopback
        member without --insecure."""
        entries = [e.strip() for e in endpoint.split(",")]
        if any(e.startswith(HTTPS) for e in entries) and not self.tls:
            raise UserError(f"--etcd {endpoint} is https but no --etcd-ca was given (the CA "
                            "that signed etcd's server certificate)")
        if self.tls and any(e.startswith(HTTP) for e in entries):
            raise UserError(f"--etcd {endpoint} names http:// but --etcd-ca asks for TLS; "
                            "write https:// or HOST:PORT")
        if not self.tls:
            for host in hosts:
                refuse_plaintext(f"etcd at {host}", host, insecure=self.insecure,
                                 fix="give --etcd-ca (and a client certificate or user)")

    def args(self) -> list[str]:
        """Flags that give a process we start the same access (the password by its file; a
        password from the environment reaches the child through its environment)."""
        out = []
        for name, flag in (("ca", "--etcd-ca"), ("cert", "--etcd-cert"), ("key", "--etcd-key"),
                           ("password_file", "--etcd-password-file")):
            if name in self.files:
                out += [flag, str(Path(self.files[name]).resolve())]
        if self.user:
            out += ["--etcd-user", self.user]
        if self.insecure:
            out.append("--insecure")
        return out
