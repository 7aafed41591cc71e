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

from lazarus.core.errors import UserError

# Every key of ours lives under this prefix (lazarus.core.records.Keys).
DEFAULT_ROOT = "/lazarus/v1/"
ETCD_ENV = "LAZARUS_ETCD"
DEFAULT_ETCD = "127.0.0.1:2379"

LEASE_TTL_S = 5
# Below this a lease expires between two refreshes of a busy process (refresh every TTL/3),
# and etcd restarts lease timers with a floor of its own: a dead node would show no sooner.
MIN_LEASE_TTL_S = 2


def check_lease_ttl(ttl_s: int, *, flag: str = "--lease-ttl") -> int:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < MIN_LEASE_TTL_S:
        raise UserError(f"{flag} must be a whole number of seconds >= {MIN_LEASE_TTL_S}, "
                        f"got {ttl_s!r}")
    return ttl_s


def add_etcd_args(p: argparse.ArgumentParser, *, etcd_help: str | None = None,
                  lease_ttl: int | None = None, lease_help: str = "lease TTL in seconds") -> None:
    """--etcd and --root, as every process that talks to etcd takes them; --lease-ttl too when
    `lease_ttl` gives its default."""
    p.add_argument("--etcd", default=os.environ.get(ETCD_ENV, DEFAULT_ETCD),
                   help=etcd_help or "etcd endpoint HOST:PORT, or several members "
                                     f"HOST:PORT,HOST:PORT,... (default %(default)s; env {ETCD_ENV})")
    p.add_argument("--root", default=DEFAULT_ROOT, help="key prefix in etcd (default %(default)s)")
    if lease_ttl is not None:
        p.add_argument("--lease-ttl", type=int, default=lease_ttl,
                       help=f"{lease_help} (default %(default)s, at least {MIN_LEASE_TTL_S})")
