"""Settings that cross process boundaries, each defined and validated here once.

The lease TTL is the one that matters most: an agent's lease is how its node's death shows
(node loss is detected one TTL after the agent stops refreshing), the leader's lease is how
long a dead daemon holds the run, and the daemon waits one TTL for the root cause of a
peer-lost failure. Agents publish the TTL they use in their node record, so the daemon reads
it from there rather than assuming its own.
"""

from __future__ import annotations

import argparse
import os
import re

from lazarus.core import etcd_auth as _auth
from lazarus.core.errors import UserError

# Every key of ours lives under this prefix (lazarus.core.records.Keys).
DEFAULT_ROOT = "/lazarus/v1/"
ETCD_ENV = "LAZARUS_ETCD"
DEFAULT_ETCD = "127.0.0.1:2379"

LEASE_TTL_S = 5
# Below this a lease expires between two refreshes of a busy process (refresh every TTL/3),
# and etcd restarts lease timers with a floor of its own: a dead node would show no sooner.
MIN_LEASE_TTL_S = 2


# Where the operator CLI finds the daemons' API (lazarus.ops.client), as --address takes it.
ADDRESS_ENV = "LAZARUS_ADDRESS"
_ADDRESS_USAGE = "give HOST:PORT, or several as HOST:PORT,HOST:PORT"
_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]")


def api_addresses(text: str, source: str) -> list[str]:
    """The daemon API addresses of a comma-separated list (--address, $LAZARUS_ADDRESS),
    each checked, in the order given; UserError naming `source` and the bad entry.

    A Kubernetes Service's name is one entry like any other: the Service, not the list,
    spreads the connections over the daemons behind it."""
    entries = [entry.strip() for entry in text.split(",")]
    if "" in entries:
        raise UserError(f"{source} {text!r} has an empty entry; {_ADDRESS_USAGE}")
    return [check_api_address(entry, source) for entry in entries]


def check_api_address(entry: str, source: str) -> str:
    """`entry` if it is HOST:PORT (an IPv6 host in brackets); UserError naming `source`."""
    host, colon, port = entry.rpartition(":")
    if "://" in entry:
        why = "takes no scheme (TLS is --tls or --tls-ca)"
    elif not colon or not host:
        why = "is not HOST:PORT"
    elif not _HOST.fullmatch(host):
        why = f"has host {host!r}, not a name or address (IPv6 goes in brackets: [::1]:7070)"
    elif not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        why = f"has port {port!r}, not a number from 1 to 65535"
    else:
        return entry
    raise UserError(f"{source}: {entry!r} {why}; {_ADDRESS_USAGE}")


def check_lease_ttl(ttl_s: int, *, flag: str = "--lease-ttl") -> int:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < MIN_LEASE_TTL_S:
        raise UserError(f"{flag} must be a whole number of seconds >= {MIN_LEASE_TTL_S}, "
                        f"got {ttl_s!r}")
    return ttl_s


def add_etcd_args(p: argparse.ArgumentParser, *, etcd_help: str | None = None,
                  lease_ttl: int | None = None, lease_help: str = "lease TTL in seconds",
                  insecure_api: bool = False) -> None:
    """--etcd and --root, how to reach etcd securely (TLS, user; lazarus.core.etcd_auth) and
    --insecure, as every process that talks to etcd takes them; --lease-ttl too when
    `lease_ttl` gives its default. `etcd_auth(args)` reads what they name."""
    p.add_argument("--etcd", default=os.environ.get(ETCD_ENV, DEFAULT_ETCD),
                   help=etcd_help or "etcd endpoint HOST:PORT or https://HOST:PORT, or several "
                                     "members HOST:PORT,HOST:PORT,... (default %(default)s; env "
                                     f"{ETCD_ENV})")
    p.add_argument("--root", default=DEFAULT_ROOT, help="key prefix in etcd (default %(default)s)")
    add_etcd_security_args(p, insecure_api=insecure_api)
    if lease_ttl is not None:
        p.add_argument("--lease-ttl", type=int, default=lease_ttl,
                       help=f"{lease_help} (default %(default)s, at least {MIN_LEASE_TTL_S})")


def add_etcd_security_args(p: argparse.ArgumentParser, *, insecure_api: bool = False) -> None:
    """TLS and user for etcd, and --insecure (which, with `insecure_api`, also lets the
    daemon serve its API in plaintext on a non-loopback address)."""
    g = p.add_argument_group("etcd security (docs/operations.md, 'Securing etcd')")
    g.add_argument("--etcd-ca", metavar="FILE",
                   help=f"TLS to etcd: the CA that signed its server certificate, PEM (env "
                        f"{_auth.CA_ENV})")
    g.add_argument("--etcd-cert", metavar="FILE",
                   help=f"client certificate for etcd, PEM (env {_auth.CERT_ENV})")
    g.add_argument("--etcd-key", metavar="FILE",
                   help=f"private key of --etcd-cert, PEM (env {_auth.KEY_ENV})")
    g.add_argument("--etcd-user", metavar="NAME",
                   help=f"etcd user to authenticate as (env {_auth.USER_ENV})")
    g.add_argument("--etcd-password-file", metavar="FILE",
                   help=f"file holding that user's password (env "
                        f"{_auth.PASSWORD_FILE_ENV}; or the password itself in env "
                        f"{_auth.PASSWORD_ENV})")
    g.add_argument("--insecure", action="store_true",
                   help="allow plaintext (no TLS) to a non-loopback etcd"
                        + (" and for the API on a non-loopback address" if insecure_api else ""))


def etcd_auth(args: argparse.Namespace) -> _auth.EtcdAuth:
    """What add_etcd_args' security flags (or their environment variables) name, read and
    checked: a UserError for a missing file or a user without a password."""
    return _auth.EtcdAuth.load(ca=args.etcd_ca, cert=args.etcd_cert, key=args.etcd_key,
                               user=args.etcd_user, password_file=args.etcd_password_file,
                               insecure=args.insecure)


def rank_threads_env(nproc: int, environ=os.environ) -> dict[str, str]:
    """The OpenMP settings of the `nproc` ranks of one host, each unless the operator set it.

    OMP_NUM_THREADS: the CPUs this process may run on, shared among them. torch otherwise
    starts an intra-op thread per core in every rank -- 8 ranks on a 96-core node, 768
    threads -- and the ranks' CPU work (data, optimizer, the CPU collectives) fights over the
    cores.

    OMP_WAIT_POLICY=PASSIVE: a thread that waits for its team sleeps instead of spinning. A
    spinning thread burns the CPU time it waits, so on a host that other work contends the
    ranks' CPU time per step (the straggler test's measure on CPU, lazarus.trainer.steptime)
    grows with the contention, not with the rank's work: measured here (2 cores, two busy
    processes beside a 2-thread matmul loop), 1.57x the CPU time spinning, 1.09x passive, at
    the same wall time. Spinning threads also take cores from a GPU rank's data loaders."""
    out = {}
    if "OMP_NUM_THREADS" not in environ:
        cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count())
        out["OMP_NUM_THREADS"] = str(max(1, (cpus or 1) // max(1, nproc)))
    if "OMP_WAIT_POLICY" not in environ:
        out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out
