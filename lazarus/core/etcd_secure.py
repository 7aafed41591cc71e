"""The secure mode of an embedded etcd (`lazarus up` runs in it): everything made at start.

In `directory`:
- ca.pem (and ca-key.pem): a CA of its own (lazarus.core.certs);
- one server certificate per member (<member>.pem), valid for 127.0.0.1 and localhost, used
  for clients and peers alike;
- client.pem / client-key.pem: the client certificate every process of ours presents. Its
  common name is no etcd user, so the certificate alone grants nothing: it lets a process
  connect, its password says who it is;
- root.password, lazarus-daemon.password, lazarus-agent.password (mode 0600): the users of
  lazarus.core.etcd_rbac, with random passwords.
The members require client certificates (--client-cert-auth) from clients and peers, and
authentication is turned on once the cluster is up (`enable`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from lazarus.core import etcd as E
from lazarus.core import etcd_rbac
from lazarus.core.certs import CertAuthority, CertFiles
from lazarus.core.etcd_auth import EtcdAuth
from lazarus.core.settings import DEFAULT_ROOT

LOOPBACK = ("127.0.0.1", "localhost")
CLIENT_NAME = "client"
USERS = (etcd_rbac.ROOT_USER, etcd_rbac.DAEMON_USER, etcd_rbac.AGENT_USER)


class EtcdSecurity:
    """Certificates and users of one embedded etcd (one member or a cluster)."""

    def __init__(self, directory: Path, *, root: str = DEFAULT_ROOT):
        self.directory = Path(directory)
        self.root = root
        self.ca = CertAuthority(self.directory)
        self.client = self.ca.issue(CLIENT_NAME)
        self.password_files: dict[str, Path] = {}
        for user in USERS:
            path = self.directory / f"{user}.password"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24))
            self.password_files[user] = path
        self.enabled = False

    def server_cert(self, member: str) -> CertFiles:
        return self.ca.issue(member, server=True, client=True, hosts=LOOPBACK)

    def auth(self, user: str | None) -> EtcdAuth:
        """A client's access as `user` (None: the certificate alone, which etcd's
        authentication then refuses everything)."""
        return EtcdAuth.load(ca=str(self.ca.ca_file), cert=str(self.client.cert),
                             key=str(self.client.key), user=user,
                             password_file=str(self.password_files[user]) if user else None,
                             env={})

    def enable(self, endpoint: str) -> None:
        """Create our users and roles and turn etcd's authentication on (once a majority of
        members runs)."""
        etcd = E.Etcd(endpoint, auth=self.auth(None))
        try:
            passwords = {u: p.read_text() for u, p in self.password_files.items()}
            E.retry(lambda: etcd_rbac.apply(etcd, self.root, passwords), deadline_s=15)
        finally:
            etcd.close()
        self.enabled = True
