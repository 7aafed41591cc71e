"""The interface a node's ranks talk gloo over is the one that carries the agent's --host."""

from __future__ import annotations

from lazarus.agent.netif import GLOO_IFNAME_ENV, collective_env, interface_of


def test_the_interface_holding_the_host_address_is_named_for_gloo():
    assert interface_of("127.0.0.1") == "lo"
    assert collective_env("127.0.0.1", {}) == {GLOO_IFNAME_ENV: "lo"}


def test_an_address_of_no_interface_here_or_a_hostname_leaves_gloo_its_own_choice():
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface of a test host
    assert interface_of("node7.example") is None
    assert collective_env("203.0.113.77", {}) == {}
    assert collective_env("node7.example", {}) == {}


def test_the_operators_own_choice_stands():
    assert collective_env("127.0.0.1", {GLOO_IFNAME_ENV: "eth1"}) == {}
