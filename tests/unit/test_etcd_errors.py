"""Every error etcd or gRPC can answer with maps onto one type of ours (lazarus.core.etcd), so
that a loop catching EtcdUnavailable survives it; and whether another member may serve the
request decides failover. The errors are built as aetcd raises them (its own mapping of a
gRPC status), with the details etcd 3.4 sends."""

from __future__ import annotations

import asyncio

import aetcd.exceptions as aexc
import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from lazarus.core import etcd as E
from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import EtcdAuth
from lazarus.core.etcd_watcher import WatchCanceled
from lazarus.core.records import RECOVERING, RUNNING, NodeRecord, RoundRecord, RunStatus
from lazarus.daemon.actions import Decision, Emit, SetStatus, StartRound
from lazarus.daemon.etcdhealth import evicted, lease_grace_s
from lazarus.daemon.view import ClusterView

S = grpc.StatusCode


def as_aetcd_raises(code: grpc.StatusCode, details: str) -> Exception:
    try:
        aexc._handle_exception(AioRpcError(code, Metadata(), Metadata(), details=details))
    except Exception as e:  # noqa: BLE001 -- whatever aetcd turns it into
        return e
    raise AssertionError("aetcd did not raise")


@pytest.mark.parametrize("code, details, kind, member_fault", [
    (S.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded", E.EtcdNoSpace, False),
    (S.RESOURCE_EXHAUSTED, "Received message larger than max (5242880 vs. 4194304)",
     E.EtcdTooLarge, False),
    (S.RESOURCE_EXHAUSTED, "etcdserver: too many requests", E.EtcdUnavailable, True),
    (S.UNAVAILABLE, "etcdserver: no leader", E.EtcdNoLeader, True),
    (S.UNAVAILABLE, "etcdserver: leader changed", E.EtcdNoLeader, True),
    (S.UNAVAILABLE, "etcdserver: request timed out, possibly due to previous leader failure",
     E.EtcdNoLeader, True),
    (S.UNAVAILABLE, "failed to connect to all addresses; last error: Connection refused",
     E.EtcdUnavailable, True),
    (S.DEADLINE_EXCEEDED, "Deadline Exceeded", E.EtcdUnavailable, True),
    (S.CANCELLED, "Channel closed", E.EtcdUnavailable, True),
    (S.INTERNAL, "Internal error from Core", E.EtcdUnavailable, True),
    (S.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted",
     E.EtcdCompacted, False),
    (S.INVALID_ARGUMENT, "etcdserver: request is too large", E.EtcdRefused, False),
    (S.PERMISSION_DENIED, "etcdserver: permission denied", E.EtcdPermissionDenied, False),
    (S.UNKNOWN, "auth: permission denied", E.EtcdPermissionDenied, False),
    (S.FAILED_PRECONDITION, "etcdserver: user name not found", E.EtcdPermissionDenied, False),
    (S.UNAUTHENTICATED, "etcdserver: invalid auth token", E.EtcdTokenExpired, False),
    (S.FAILED_PRECONDITION, "etcdserver: something new", E.EtcdRefused, False),
])
def test_grpc_errors_map_onto_our_types(code, details, kind, member_fault):
    got = E.classify(as_aetcd_raises(code, details), "10.0.0.1:2379")
    assert type(got) is kind
    assert isinstance(got, E.EtcdUnavailable)  # a loop catching it survives
    assert got.member_fault is member_fault


@pytest.mark.parametrize("reason, kind", [
    # a watch created on a stream whose token etcd forgot (restarted, or the token idled out)
    ("rpc error: code = Unauthenticated desc = etcdserver: invalid auth token",
     E.EtcdTokenExpired),
    ("rpc error: code = PermissionDenied desc = etcdserver: permission denied",
     E.EtcdPermissionDenied),
    ("something etcd has not said before", E.EtcdUnavailable),
])
def test_watches_etcd_cancels_map_onto_our_types(reason, kind):
    """etcd cancels a watch with a reason (a Go gRPC error as text), not with a gRPC error."""
    assert type(E.classify(WatchCanceled(reason), "10.0.0.1:2379")) is kind


@pytest.mark.parametrize("details, expect", [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.1:2379: Tls "
     "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
     "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED", "is its server certificate signed by "
                                                  "--etcd-ca and valid for 10.0.0.1:2379?"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:10.0.0.1:2379: "
     "Unwrap failed (TSI_DATA_CORRUPTED)", "it asks for a client certificate"),
])
def test_tls_failures_say_which_certificate_to_fix(details, expect):
    tls = EtcdAuth(ca=b"-----BEGIN CERTIFICATE-----")
    got = E.classify(as_aetcd_raises(S.UNAVAILABLE, details), "10.0.0.1:2379", tls)
    assert type(got) is E.EtcdTLSError and got.member_fault and expect in str(got)
    # without TLS the same words are not ours to explain
    assert type(E.classify(as_aetcd_raises(S.UNAVAILABLE, details), "10.0.0.1:2379")) \
        is E.EtcdUnavailable


def test_permission_denied_names_the_user_or_its_absence():
    denied = as_aetcd_raises(S.PERMISSION_DENIED, "etcdserver: permission denied")
    assert "etcd user 'lazarus-agent' has no right to it" in str(
        E.classify(denied, "m:1", EtcdAuth(user="lazarus-agent", password="x")))
    assert "no --etcd-user was given and etcd requires one" in str(E.classify(denied, "m:1"))


def test_a_forgotten_lease_is_lease_lost_not_an_outage():
    got = E.classify(as_aetcd_raises(S.NOT_FOUND, "etcdserver: requested lease not found"), "a:1")
    assert isinstance(got, E.LeaseLost)


@pytest.mark.parametrize("error, kind", [
    (aexc.RevisionCompactedError(42), E.EtcdCompacted),
    (aexc.WatchTimeoutError(), E.EtcdUnavailable),
    (TimeoutError(), E.EtcdUnavailable),
    (asyncio.CancelledError(), E.EtcdUnavailable),
])
def test_client_side_errors_map_too(error, kind):
    assert type(E.classify(error, "a:1")) is kind


def test_a_bug_of_ours_is_not_disguised_as_an_etcd_error():
    assert E.classify(KeyError("x"), "a:1") is None


def test_messages_say_what_happened_and_what_to_do():
    nospace = E.classify(as_aetcd_raises(S.RESOURCE_EXHAUSTED,
                                         "etcdserver: mvcc: database space exceeded"), "a:1")
    assert "NOSPACE" in str(nospace) and "defragmented" in str(nospace)
    noleader = E.classify(as_aetcd_raises(S.UNAVAILABLE, "etcdserver: no leader"), "h:2379")
    assert "etcd at h:2379 has no leader" in str(noleader) and "quorum" in str(noleader)


@pytest.mark.parametrize("text, members", [
    ("127.0.0.1:2379", ["127.0.0.1:2379"]),
    ("a:2379,b:2379,c:2379", ["a:2379", "b:2379", "c:2379"]),
    ("http://a:1, http://b:2/", ["a:1", "b:2"]),
])
def test_endpoint_lists(text, members):
    assert E.parse_endpoints(text) == members


@pytest.mark.parametrize("text, expect", [
    ("a:2379,,c:2379", "etcd endpoint '' (in 'a:2379,,c:2379') is not HOST:PORT"),
    ("a:2379,b", "etcd endpoint 'b' (in 'a:2379,b') is not HOST:PORT"),
    ("a:2379,a:2379", "name a member twice"),
    ("nonsense", "etcd endpoint 'nonsense' is not HOST:PORT"),
])
def test_bad_endpoint_lists_are_one_user_error(text, expect):
    with pytest.raises(UserError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        E.parse_endpoints(text)


# -- what the leader holds while etcd is impaired -------------------------------------------------
def _view(members: list[str], ttl: int = 3) -> ClusterView:
    view = ClusterView(status=RunStatus(job_id="J", state=RUNNING, round=1, members=members))
    view.nodes = {n: NodeRecord(node=n, host="h", nproc=1, role="active", store_port=1,
                                lease_ttl_s=ttl) for n in members}
    return view


def _recovering(kind: str, culprit: str) -> SetStatus:
    return SetStatus(RunStatus(job_id="J", state=RECOVERING, round=1, members=["n0", "n1"],
                               incident={"kind": kind, "culprit": culprit}))


def _round(members: list[str]) -> StartRound:
    return StartRound(RoundRecord(round=2, job_id="J", members=members, nproc_per_node=1,
                                  world_size=len(members), dp=len(members), tp=1,
                                  store_host="h", store_port=1))


@pytest.mark.parametrize("actions, nodes", [
    ([_recovering("node_lost", "n1"), Emit("fault_detected", "")], ["n1"]),
    ([_recovering("rendezvous_timeout", "n0,n1")], ["n0", "n1"]),
    ([_recovering("worker_crash", "n1")], []),       # a crash report is not an absence
    ([_round(["n0", "n2"])], ["n1"]),                 # promote a spare in n1's place
    ([_round(["n0", "n1"])], []),                     # same members again
    ([Emit("running", "")], []),
])
def test_which_decisions_evict(actions, nodes):
    assert evicted(Decision(actions, "why"), _view(["n0", "n1"])) == nodes


def test_the_grace_after_an_outage_is_the_longest_node_lease():
    view = _view(["n0", "n1"], ttl=7)
    assert lease_grace_s(view) == 8.0
