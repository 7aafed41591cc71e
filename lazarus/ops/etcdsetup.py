"""`lazarus etcd`: secure an etcd for Lazarus, without etcdctl (docs/operations.md, "Securing
etcd").

    lazarus etcd certs DIR --host etcd-0.example --host 10.0.0.5
        a CA, a server certificate for those hosts (and loopback), and a client certificate
        (DIR/ca.pem, server.pem, server-key.pem, client.pem, client-key.pem)
    lazarus etcd passwords DIR
        DIR/<user>.password for root, lazarus-daemon and lazarus-agent, random, where missing
    lazarus etcd enable-auth --etcd https://10.0.0.5:2379 --etcd-ca DIR/ca.pem \\
            --etcd-cert DIR/client.pem --etcd-key DIR/client-key.pem --passwords DIR
        the users root, lazarus-daemon and lazarus-agent with their roles
        (lazarus.core.etcd_rbac), their passwords in DIR/<user>.password (made when missing),
        then etcd's authentication on. Run again, it sets the passwords of the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import time
from pathlib import Path

from lazarus.core import etcd as E
from lazarus.core import etcd_rbac, settings
from lazarus.core.certs import CertAuthority
from lazarus.core.errors import UserError

USERS = (etcd_rbac.ROOT_USER, etcd_rbac.DAEMON_USER, etcd_rbac.AGENT_USER)


def certs(directory: Path, hosts: list[str], days: int) -> list[Path]:
    if (directory / "ca.pem").exists():
        raise UserError(f"{directory} already holds a CA (ca.pem): give an empty directory, "
                        "so that no certificate in use is replaced by mistake")
    ca = CertAuthority(directory, days=days)
    server = ca.issue("server", server=True, client=True,
                      hosts=tuple(dict.fromkeys([*hosts, "127.0.0.1", "localhost"])))
    client = ca.issue("client")
    return [ca.ca_file, server.cert, server.key, client.cert, client.key]


def passwords(directory: Path) -> dict[str, str]:
    """user -> password from DIR/<user>.password; a missing file is made (random, 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for user in USERS:
        path = directory / f"{user}.password"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24))
        try:
            out[user] = path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror})") from None
        if not out[user]:
            raise UserError(f"{path} is empty")
    return out


def enable_auth(endpoint: str, auth, root: str, pw: dict[str, str], *,
                wait_s: float = 30.0) -> str:
    """Without a user while etcd's authentication is off; as root once it is on. Waits up
    to `wait_s` for etcd to answer (a script starts it just before)."""
    as_root = dataclasses.replace(auth, user=etcd_rbac.ROOT_USER,
                                  password=pw[etcd_rbac.ROOT_USER])
    deadline = time.monotonic() + wait_s
    backoff = E.Backoff(initial_s=0.2, max_s=2.0)
    access = auth
    while True:
        etcd = E.Etcd(endpoint, auth=access)
        try:
            etcd_rbac.apply(etcd, root, pw)
            return "updated" if access is as_root else "enabled"
        except E.EtcdPermissionDenied:
            if access is as_root:
                raise
            access = as_root  # authentication is on already
        except E.EtcdUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(backoff.next())
        finally:
            etcd.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lazarus etcd", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("certs", help="make a CA and certificates for etcd and its clients")
    c.add_argument("dir", type=Path, help="where (an empty or new directory)")
    c.add_argument("--host", action="append", default=[],
                   help="a name or address clients reach etcd at (repeatable)")
    c.add_argument("--days", type=int, default=365, help="validity (default %(default)s)")
    w = sub.add_parser("passwords", help="random passwords for our etcd users, where missing")
    w.add_argument("dir", type=Path)
    a = sub.add_parser("enable-auth", help="create our users and roles, turn authentication on")
    settings.add_etcd_args(a)
    a.add_argument("--passwords", type=Path, required=True, metavar="DIR",
                   help="DIR/<user>.password for root, lazarus-daemon, lazarus-agent (made "
                        "when missing)")
    args = p.parse_args(argv)
    if args.what == "certs":
        if not args.host:
            raise UserError("give at least one --host clients reach etcd at")
        if args.days < 1:
            raise UserError("--days must be at least 1")
        for path in certs(args.dir, args.host, args.days):
            print(path)
        return 0
    if args.what == "passwords":
        passwords(args.dir)
        for user in USERS:
            print(args.dir / f"{user}.password")
        return 0
    auth = settings.etcd_auth(args)
    if auth.user is not None:
        raise UserError("enable-auth authenticates as root by itself (--passwords); give no "
                        "--etcd-user")
    pw = passwords(args.passwords)
    try:
        done = enable_auth(args.etcd, auth, args.root, pw)
    except E.EtcdUnavailable as e:
        raise UserError(str(e)) from None
    print(f"etcd authentication {done}: users {', '.join(USERS)} (passwords in "
          f"{args.passwords}); agents may write only {', '.join(etcd_rbac.AGENT_WRITES)} "
          f"under {args.root}")
    return 0
