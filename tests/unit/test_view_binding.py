"""A record is checked against its key: a node's registration and status name the node of
their key, and a status counts only under the lease of that node's registration, so one
agent cannot write another node's status. The check follows each change in O(1), whichever
of the two keys changes, as the daemon's cached view applies them."""

from __future__ import annotations

from lazarus.core.etcd import KV
from lazarus.core.records import Keys, NodeRecord, NodeStatus
from lazarus.daemon.view import ViewBuilder

KEYS = Keys("/v/")


def _kv(key: str, value: bytes, lease: int) -> KV:
    return KV(key=key, value=value, create_revision=1, mod_revision=1, version=1, lease=lease)


def node(name: str, lease: int, *, named: str | None = None):
    key = KEYS.node_key(name)
    return key, _kv(key, NodeRecord(node=named or name, host="h", nproc=1).to_json(), lease)


def status(name: str, lease: int, workers: str = "running", *, named: str | None = None):
    key = KEYS.nodestatus_key(name)
    return key, _kv(key, NodeStatus(node=named or name, round=1, workers=workers).to_json(),
                    lease)


def test_a_status_counts_only_under_the_lease_of_its_nodes_registration():
    view = ViewBuilder(KEYS)
    view.apply([node("a", 5), status("a", 5), status("b", 7), node("b", 5)])
    v = view.build(1)
    assert set(v.node_status) == {"a"} and set(v.nodes) == {"a", "b"}
    assert v.ignored == {KEYS.nodestatus_key("b"): f"{KEYS.nodestatus_key('b')}: written "
                         f"under lease 7, not under {KEYS.node_key('b')}'s lease 5: not the "
                         "node's own agent"}

    # another agent (lease 7) writes a's status: a's own status is gone, none replaces it
    view.apply([status("a", 7, "failed")])
    v = view.build(2)
    assert "a" not in v.node_status and KEYS.nodestatus_key("a") in v.ignored

    # a's agent registers again under a new lease and writes under it: counted again
    view.apply([node("a", 9), status("a", 9, "failed")])
    v = view.build(3)
    assert v.node_status["a"].workers == "failed" and KEYS.nodestatus_key("a") not in v.ignored

    # b's registration moves to the status's lease: the status is b's after all
    view.apply([node("b", 7)])
    assert set(view.build(4).node_status) == {"a", "b"}

    # a registration gone: the status left behind (no lease, or another's) is nobody's
    view.apply([(KEYS.node_key("a"), None)])
    v = view.build(5)
    assert "a" not in v.node_status
    assert "is not registered" in v.ignored[KEYS.nodestatus_key("a")]
    view.apply([(KEYS.nodestatus_key("a"), None)])
    assert view.build(6).ignored == {}


def test_records_without_a_lease_match_a_registration_without_one():
    view = ViewBuilder(KEYS)
    view.apply([node("a", 0), status("a", 0), status("b", 0), node("b", 3)])
    v = view.build(1)
    assert set(v.node_status) == {"a"} and set(v.ignored) == {KEYS.nodestatus_key("b")}


def test_a_record_must_name_the_node_of_its_key():
    view = ViewBuilder(KEYS)
    view.apply([node("a", 5), node("b", 5, named="a"), status("a", 5, named="b")])
    v = view.build(1)
    assert set(v.nodes) == {"a"} and v.node_status == {}
    assert v.ignored[KEYS.node_key("b")].endswith("names node 'a'")
    assert v.ignored[KEYS.nodestatus_key("a")].endswith("names node 'b'")
