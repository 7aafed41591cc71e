"""Which network interface a node's ranks talk gloo over: the one that carries its --host.

--host is the address the other nodes reach this node at: the round's store listens there.
gloo picks its own address from the hostname instead, which on many hosts resolves to
loopback (Debian's /etc/hosts maps it to 127.0.1.1) or to another network than --host's;
the peers are then told an address they cannot reach and the rendezvous hangs. So the agent
names the interface holding the --host address in GLOO_SOCKET_IFNAME for its ranks, unless
the operator set it (a hostname given as --host is left to gloo: which of its addresses
the peers use is the resolver's business).
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def interface_of(address: str) -> str | None:
    """The name of the interface that has `address` (an IP literal), if one here does."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None


def collective_env(host: str, environ: dict[str, str]) -> dict[str, str]:
    """What to add to the ranks' environment `environ` so that gloo binds --host's interface."""
    if environ.get(GLOO_IFNAME_ENV):
        return {}
    name = interface_of(host)
    return {GLOO_IFNAME_ENV: name} if name else {}
