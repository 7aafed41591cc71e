"""Nodes of a local cluster on a network of their own, and partitions of it.

Each node gets a network namespace joined to one bridge in the host's namespace by a veth
pair: the bridge has the subnet's first address (etcd and the daemons serve there) and node i
the (i+2)th. Its agent runs inside the namespace (`ip netns exec`) and tells its peers its
own address (`--host`), so the round's store and gloo go node to node over the bridge; the
ranks inherit the namespace, and gloo binds the interface that carries that address
(lazarus.agent.netif).

A partition is made of blackhole routes, set on both sides so that neither direction passes:
a node cut off from etcd can still reach its peers (bridged traffic never meets the host's
routes), and a node cut off from its peers still reaches etcd. Connections open across a cut
do not fail: their packets are dropped and they stall, as over a broken switch port, until
the cut heals. Root only (CAP_NET_ADMIN); `unavailable()` says why not.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from lazarus.core.errors import UserError
from lazarus.sim.localcluster import Placement

# Subnets tried in turn; the first one no route of this host touches is taken (another
# cluster's network on this host included).
SUBNETS = [ipaddress.ip_network(f"10.77.{i}.0/24") for i in range(256)]


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise UserError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def unavailable() -> str | None:
    """Why nodes cannot get network namespaces here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "network namespaces need ip(8) (iproute2)"
    probe = f"lazarus-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def free_subnet(routes: str) -> ipaddress.IPv4Network | None:
    """The first of SUBNETS that no destination or address in `routes` (the output of
    `ip -4 route show table all`) falls in; the default route claims nothing."""
    used = []
    for token in routes.split():
        try:
            net = ipaddress.ip_network(token, strict=False)
        except ValueError:
            continue
        if net.version == 4 and net.prefixlen > 0:
            used.append(net)
    return next((s for s in SUBNETS if not any(s.overlaps(u) for u in used)), None)


@dataclass(slots=True)
class _Node:
    netns: str
    veth_host: str               # the end on the bridge
    veth_node: str               # the end inside the namespace
    address: str


@dataclass(slots=True)
class NodeNetwork:
    """`up()` builds the network for `nodes`, `down()` removes every namespace, link and
    route it made (also after a failed `up()`); both are safe to call twice."""
    nodes: list[str]
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    subnet: ipaddress.IPv4Network | None = None
    bridge: str = ""
    _nodes: dict[str, _Node] = field(default_factory=dict)
    _cuts: dict[str, list[tuple[str | None, str]]] = field(default_factory=dict)

    @property
    def host_address(self) -> str:
        """The host's address on the bridge: where etcd and the daemons serve the nodes."""
        assert self.subnet is not None, "up() first"
        return str(self.subnet.network_address + 1)

    def address(self, node: str) -> str:
        return self._nodes[node].address

    def placement(self, node: str) -> Placement:
        n = self._nodes[node]
        return Placement(host=n.address, wrap=("ip", "netns", "exec", n.netns))

    def up(self) -> "NodeNetwork":
        self.subnet = free_subnet(_ip("-4", "route", "show", "table", "all"))
        if self.subnet is None:
            raise UserError("no free 10.77.x.0/24 subnet for the nodes' network")
        self.bridge = f"lz{self.tag}br"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, node in enumerate(self.nodes):
                n = _Node(netns=f"lazarus-{self.tag}-{node}", veth_host=f"lz{self.tag}h{i}",
                          veth_node=f"lz{self.tag}n{i}",
                          address=str(self.subnet.network_address + 2 + i))
                self._nodes[node] = n
                _ip("netns", "add", n.netns)
                _ip("link", "add", n.veth_host, "type", "veth", "peer", "name", n.veth_node)
                _ip("link", "set", n.veth_node, "netns", n.netns)
                _ip("link", "set", n.veth_host, "master", self.bridge)
                _ip("link", "set", n.veth_host, "up")
                _ip("addr", "add", f"{n.address}/24", "dev", n.veth_node, netns=n.netns)
                _ip("link", "set", n.veth_node, "up", netns=n.netns)
                _ip("link", "set", "lo", "up", netns=n.netns)
        except UserError:
            self.down()
            raise
        return self

    # -- partitions ----------------------------------------------------------------------------
    def cut(self, node: str, *, etcd: bool = False, peers: bool = False) -> str:
        """Cut `node` off from the host (etcd, the daemons) and/or from every other node."""
        me = self._nodes[node]
        pairs: list[tuple[str | None, str]] = []
        if etcd:
            pairs += [(me.netns, self.host_address), (None, me.address)]
        if peers:
            for other, n in self._nodes.items():
                if other != node:
                    pairs += [(me.netns, n.address), (n.netns, me.address)]
        done = self._cuts.setdefault(node, [])
        for netns, address in pairs:
            _ip("route", "add", "blackhole", f"{address}/32", netns=netns)
            done.append((netns, address))
        what = " and ".join(w for w, on in (("etcd", etcd), ("its peers", peers)) if on)
        return f"{node} cut off from {what}"

    def heal(self, node: str) -> str:
        for netns, address in self._cuts.pop(node, []):
            _ip("route", "del", "blackhole", f"{address}/32", netns=netns, check=False)
        return f"{node} reconnected"

    def down(self) -> None:
        for node in list(self._cuts):
            self.heal(node)
        for n in self._nodes.values():
            # Deleting either end of a veth pair deletes both; the namespace goes once the
            # last process in it has exited (the cluster stops them first).
            _ip("link", "del", n.veth_host, check=False)
            _ip("netns", "del", n.netns, check=False)
        self._nodes.clear()
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
            self.bridge = ""
