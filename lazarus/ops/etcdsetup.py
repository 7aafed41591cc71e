"""`lazarus etcd`: secure an etcd for Lazarus, without etcdctl (docs/operations.md, "Securing
etcd" and "A three-member etcd with TLS").

    lazarus etcd certs DIR --hosts etcd-1.example,etcd-2.example,etcd-3.example
        a CA (DIR/ca.pem, ca-key.pem), a client certificate (client.pem, client-key.pem), and
        per member DIR/MEMBER/server.pem, server-key.pem (its client port) and peer.pem,
        peer-key.pem (its peer port). Run again with more members, it adds theirs, signed by
        the same CA; it never replaces a file.
    lazarus etcd certs DIR --host etcd-0.example --host 10.0.0.5
        instead of per member: one server certificate for those hosts (and loopback), for
        clients and peers alike (DIR/server.pem, server-key.pem)
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
from lazarus.core.certs import CertAuthority, check_host, hosts_of, paths
from lazarus.core.errors import UserError
from lazarus.core.etcd_secure import LOOPBACK

USERS = (etcd_rbac.ROOT_USER, etcd_rbac.DAEMON_USER, etcd_rbac.AGENT_USER)


def certs(directory: Path, hosts: list[str], members: list[str],
          days: int) -> list[tuple[str, Path, str]]:
    """("made" or "kept", file, what it is for) for each file of `directory` that `hosts`
    (one server certificate for all) and `members` (a server and a peer certificate each)
    call for, with the CA and the client certificate. A file already there is kept, never
    replaced: run again with a new member, and only its files are made, signed by the CA
    there. Everything is checked before anything is made. Server certificates carry
    clientAuth too: etcd's own HTTP gateway presents its server certificate to its client
    port, which asks clients for one (without it, etcd 3.4's /v3/ JSON API fails)."""
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory} is not a directory")
    ca_there = (directory / "ca.pem").exists()
    if not ca_there and directory.exists() and any(directory.iterdir()):
        raise UserError(f"{directory} holds files but no CA (ca.pem): give an empty or new "
                        "directory, or one `lazarus etcd certs` made")
    # (where, common name, how to issue, what the certificate is for, what its key is for)
    wanted = [("client", "client", {},
               "the client certificate of daemons, agents and the CLI: --etcd-cert",
               "its key: --etcd-key")]
    if hosts:
        wanted.append(("server", "server",
                       {"server": True, "hosts": tuple(dict.fromkeys([*hosts, *LOOPBACK]))},
                       "every member's --cert-file and --peer-cert-file",
                       "its key: --key-file and --peer-key-file"))
    for member in members:
        # loopback too: an operator's check on the member's own host dials 127.0.0.1, and
        # etcd accepts a peer only from an address its certificate names, which for members
        # sharing one host (a trial, tests/deploy) is 127.0.0.1
        how = {"server": True, "hosts": tuple(dict.fromkeys([member, *LOOPBACK]))}
        wanted += [(f"{member}/server", member, how, f"{member}'s --cert-file",
                    f"{member}'s --key-file"),
                   (f"{member}/peer", member, how, f"{member}'s --peer-cert-file",
                    f"{member}'s --peer-key-file")]
    plan = []
    for stem, name, how, cert_what, key_what in wanted:
        files = paths(directory, stem)
        there = [p for p in (files.cert, files.key) if p.exists()]
        if len(there) == 1:
            missing = files.key if there[0] == files.cert else files.cert
            raise UserError(f"{there[0]} is there but not {missing.name}: put it back, or "
                            f"move {there[0].name} away to have both made anew")
        if there and stem == "server":
            _check_covers(files.cert, how["hosts"])
        plan.append((bool(there), stem, name, how, [(files.cert, cert_what),
                                                     (files.key, key_what)]))
    try:
        ca = CertAuthority.load(directory, days=days) if ca_there else CertAuthority(
            directory, days=days)
    except ValueError as e:
        raise UserError(str(e)) from None
    status = "kept" if ca_there else "made"
    out = [(status, ca.ca_file, "the CA: members' --trusted-ca-file and "
                                "--peer-trusted-ca-file, clients' --etcd-ca"),
           (status, ca.key_file, "the CA's key, to add members later: keep it off the nodes")]
    for kept, stem, name, how, files in plan:
        if not kept:
            ca.issue(name, stem=stem, **how)
        out += [("kept" if kept else "made", path, what) for path, what in files]
    return out


def _check_covers(cert: Path, hosts: tuple[str, ...]) -> None:
    """A kept server certificate must be valid for every --host asked for: otherwise the
    command would succeed and clients fail later with a TLS error."""
    missing = [h for h in hosts if h not in hosts_of(cert)]
    if missing:
        raise UserError(f"{cert} is kept (never replaced) but is not valid for "
                        f"{', '.join(missing)}: move it and its key away to make one that is, "
                        "or use --hosts for a certificate per member")


def _hosts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(--host values, --hosts members), each checked; a member is one host, no wildcard."""
    members = [h.strip() for entry in args.hosts for h in entry.split(",")]
    try:
        hosts = [check_host(h, wildcard=True) for h in args.host]
        members = [check_host(h) for h in members]
    except ValueError as e:
        raise UserError(str(e)) from None
    return hosts, list(dict.fromkeys(members))


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
    p = argparse.ArgumentParser(prog="lazarus etcd", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("certs", help="make a CA and certificates for etcd and its clients")
    c.add_argument("dir", type=Path,
                   help="where: a new or empty directory, or one this made (files there are "
                        "kept, missing ones made with its CA)")
    c.add_argument("--hosts", action="append", default=[], metavar="H1,H2,...",
                   help="etcd's members, each by the name or address others dial it at: a "
                        "server and a peer certificate per member in DIR/MEMBER/ (repeatable; "
                        "run again with a new member to add its certificates)")
    c.add_argument("--host", action="append", default=[],
                   help="instead: one server certificate DIR/server.pem for every --host "
                        "(repeatable) and loopback, that members share")
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
        hosts, members = _hosts(args)
        if not hosts and not members:
            raise UserError("give --hosts H1,H2,H3 (etcd's members) or --host (a name of a "
                            "certificate they share)")
        if args.days < 1:
            raise UserError("--days must be at least 1")
        try:
            files = certs(args.dir, hosts, members, args.days)
        except OSError as e:
            raise UserError(f"{e.filename}: {e.strerror}") from None
        width = max(len(str(path)) for _, path, _ in files)
        for status, path, what in files:
            print(f"{status}  {str(path):<{width}}  {what}")
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
