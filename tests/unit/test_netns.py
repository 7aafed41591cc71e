"""The local cluster's node network takes a subnet no route of the host touches."""

from __future__ import annotations

import ipaddress

from lazarus.sim.netns import free_subnet

ROUTES = """default via 192.0.2.1 dev eth0
192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2
10.77.0.0/24 dev lz1br proto kernel scope link src 10.77.0.1
blackhole 10.77.1.5
local 127.0.0.0/8 dev lo table local proto kernel scope host src 127.0.0.1
"""


def test_a_subnet_in_use_or_holding_a_route_is_skipped_and_the_default_route_claims_nothing():
    assert free_subnet(ROUTES) == ipaddress.ip_network("10.77.2.0/24")
    assert free_subnet("default via 192.0.2.1 dev eth0\n") == ipaddress.ip_network("10.77.0.0/24")


def test_a_host_route_covering_every_candidate_leaves_none():
    assert free_subnet("10.0.0.0/8 dev eth9\n") is None
