"""lazarus.core.etcd against real etcd servers: a full database (NOSPACE), reads larger than
gRPC's 4 MiB, compacted watches, the leader's compaction, a 3-member cluster losing one
member, then its quorum; and what the leader holds back while etcd is impaired. No training
here (tests/integration/test_etcd_cluster.py has it)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedCluster, EmbeddedEtcd
from lazarus.core.records import RECOVERING, RUNNING, EventRecord, Keys, NodeRecord, RunStatus
from lazarus.daemon.actions import Decision, SetStatus
from lazarus.daemon.compaction import Compactor
from lazarus.daemon.etcdhealth import EtcdHealth, lease_grace_s
from lazarus.daemon.leader import Leadership
from lazarus.daemon.view import ClusterView

MiB = 1 << 20


def fill(etcd: E.Etcd, prefix: str) -> int:
    """Write 1 MiB values until etcd refuses; returns how many went in."""
    blob = b"x" * (MiB - 1024)
    for n in range(10_000):
        try:
            etcd.put(f"{prefix}{n:05d}", blob)
        except E.EtcdNoSpace:
            return n
    raise AssertionError("etcd never ran out of space")


def free(etcd: E.Etcd, prefix: str) -> None:
    """What docs/operations.md tells an operator to do."""
    etcd.delete(prefix, prefix=True)
    etcd.compact(etcd.revision("/"))
    etcd.defragment()
    for alarm in etcd.alarms():
        etcd.disarm(alarm)


def test_nospace_refuses_writes_only_and_is_one_line_until_it_is_cleared(tmp_path, caplog):
    with EmbeddedEtcd(tmp_path / "etcd", quota_bytes=16 * MiB) as server:
        etcd = E.Etcd(server.endpoint)
        try:
            etcd.put("/k", b"before")
            session = E.Session(etcd, ttl_s=3)
            assert fill(etcd, "/ballast/") > 0
            assert [a.kind for a in etcd.alarms()] == ["NOSPACE"]
            outage = E.OutageLog(etcd, logging.getLogger("test.agent"), "workers keep training")
            with caplog.at_level(logging.INFO, logger="test.agent"):
                for _ in range(3):
                    with pytest.raises(E.EtcdNoSpace):
                        etcd.put("/k", b"during")
                    outage.failed(E.EtcdNoSpace("etcd is out of space"))
                    # reads, read-only compares and lease keep-alives still work
                    assert etcd.get("/k").value == b"before"
                    assert etcd.txn([E.value_is("/k", b"before")])
                    assert etcd.refresh(session.lease) > 0
                    assert outage.ok() is None  # a pass that only read says nothing
                with pytest.raises(E.EtcdNoSpace):
                    etcd.grant(5)  # a new session cannot start
                with pytest.raises(E.EtcdNoSpace):
                    etcd.txn([], [E.put_op("/k", b"during")])
                free(etcd, "/ballast/")
                etcd.put("/k", b"after")
                assert outage.ok() is not None
            lines = [r.getMessage() for r in caplog.records if r.name == "test.agent"]
            assert lines == ["etcd is out of space; workers keep training",
                             lines[-1]] and lines[-1].startswith("etcd is back after")
            assert not session.lost.is_set() and etcd.alarms() == []
            session.close()
        finally:
            etcd.close()


def test_reads_larger_than_grpc_allows_are_paged_at_one_revision(etcd, keys):
    # 7.2 MB under one prefix: more than gRPC's 4 MiB, and so is a first page of 1,000 keys
    value = b"v" * 6000
    names = [f"{keys.nodestatus}n{i:04d}" for i in range(1200)]
    for i in range(0, len(names), 100):
        etcd.txn([], [E.put_op(n, value) for n in names[i:i + 100]])
    etcd.put(keys.status, b"{}")
    snap = etcd.snapshot([keys.nodestatus, keys.status])
    assert sorted(snap.kvs) == sorted([*names, keys.status])
    assert max(kv.mod_revision for kv in snap.kvs.values()) <= snap.revision
    assert len(etcd.get_prefix(keys.nodestatus).kvs) == len(names)
    etcd.delete(keys.root, prefix=True)


def test_a_watch_whose_revision_was_compacted_relists_and_goes_on(etcd, keys):
    first = etcd.put(keys.root + "a", b"1")
    etcd.put(keys.root + "a", b"2")
    etcd.compact(etcd.revision("/"))
    resynced = threading.Event()
    seen: list[bytes] = []

    def resync() -> int:
        resynced.set()
        return etcd.revision("/") + 1

    watch = etcd.watch_prefix(keys.root, start_revision=first,
                              on_events=lambda evs: seen.extend(e.kv.value for e in evs),
                              on_resync=resync)
    try:
        assert resynced.wait(10)
        time.sleep(0.2)  # the watch is re-created after the re-list
        etcd.put(keys.root + "a", b"3")
        deadline = time.monotonic() + 10
        while b"3" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == [b"3"]  # nothing from before the re-list, nothing lost after
    finally:
        watch.cancel()


def test_the_leader_compacts_what_is_old_enough_and_consumed(etcd, keys):
    old = etcd.put(keys.root + "k", b"0")
    consumed = [old]
    compactor = Compactor(etcd, root="/", every_s=0.3, keep_s=0.5, consumed=lambda: consumed[0])
    assert compactor.tick(leading=False) is None
    deadline = time.monotonic() + 10
    done = None
    while done is None and time.monotonic() < deadline:
        etcd.put(keys.root + "k", b"1")
        done = compactor.tick(leading=True)
        time.sleep(0.05)
    assert done == old  # not past what our watch consumed, though newer revisions are old enough
    consumed[0] = etcd.revision("/")
    deadline = time.monotonic() + 10
    later = None
    while later is None and time.monotonic() < deadline:
        etcd.put(keys.root + "k", b"2")
        later = compactor.tick(leading=True)
        time.sleep(0.05)
    assert later is not None and old < later <= consumed[0]
    compacted = threading.Event()
    watch = etcd.watch_prefix(keys.root, start_revision=old + 1, on_events=lambda _e: None,
                              on_resync=lambda: compacted.set() or etcd.revision("/") + 1)
    try:
        assert compacted.wait(10)  # history before `later` is gone
    finally:
        watch.cancel()


def test_a_client_of_three_members_rides_out_one_loss_and_tells_a_lost_quorum(tmp_path):
    with EmbeddedCluster(tmp_path / "etcd") as cluster:
        etcd = E.Etcd(cluster.endpoint)
        seen: list[str] = []
        try:
            session = E.Session(etcd, ttl_s=3)
            watch = etcd.watch_prefix("/w/", start_revision=etcd.revision("/") + 1,
                                      on_events=lambda evs: seen.extend(e.kv.key for e in evs))
            etcd.put("/w/1", b"")
            cluster.members[0].kill()  # the member this client talks to
            # served by another member (after an election, if the lost one led)
            E.retry(lambda: etcd.put("/w/2", b""), deadline_s=20)
            assert etcd.member != cluster.members[0].endpoint
            cluster.members[1].kill()  # no quorum left
            with pytest.raises(E.EtcdUnavailable):
                etcd.get("/w/1")
            time.sleep(4)              # longer than the lease TTL
            t0 = time.monotonic()
            # once the last member has noticed, it says so at once (not after a timeout)
            with pytest.raises(E.EtcdNoLeader, match="has no leader"):
                etcd.get("/w/1")
            assert time.monotonic() - t0 < etcd.timeout_s
            cluster.restart(0)
            cluster.restart(1)
            E.retry(lambda: etcd.put("/w/3", b""), deadline_s=20)
            deadline = time.monotonic() + 10
            while len(seen) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert list(dict.fromkeys(seen)) == ["/w/1", "/w/2", "/w/3"]  # a retried put may repeat
            assert not session.lost.is_set()  # etcd restarted the lease timer with its leader
            assert etcd.refresh(session.lease) > 0
            watch.cancel()
            session.close()
        finally:
            etcd.close()


def test_the_leader_holds_evictions_through_nospace_and_records_the_alarm(tmp_path):
    with EmbeddedEtcd(tmp_path / "etcd", quota_bytes=16 * MiB) as server:
        etcd = E.Etcd(server.endpoint)
        keys = Keys("/t/")
        try:
            leadership = Leadership(etcd, keys, ttl_s=3, identity={"id": "test"})
            assert leadership.campaign()
            health = EtcdHealth(etcd, keys, writer="test", alarm_poll_s=0)
            view = ClusterView(status=RunStatus(job_id="J", state=RUNNING, round=1,
                                                members=["n0", "n1"]))
            view.nodes = {"n0": NodeRecord(node="n0", host="h", nproc=1, lease_ttl_s=2)}
            lost = RunStatus(job_id="J", state=RECOVERING, round=1, members=["n0", "n1"],
                             incident={"kind": "node_lost", "culprit": "n1"})
            evict = Decision([SetStatus(lost)], "node(s) n1 lost (agent lease expired)")
            health.poll(leadership)
            assert health.hold(evict, view) is None  # etcd is fine: a lost node is lost
            fill(etcd, "/ballast/")
            health.poll(leadership)
            assert "holding the eviction of n1" in health.hold(evict, view)
            free(etcd, "/ballast/")
            health.poll(leadership)  # the alarm is gone: the leader writes it down
            events = [EventRecord.from_json(kv.value)
                      for kv in etcd.get_prefix(keys.events).kvs.values()]
            assert [(e.kind, e.fields["alarm"]) for e in events] == [("etcd_alarm", "NOSPACE")]
            # still held for a lease TTL (+1 s): an agent may not have re-registered yet
            assert health.hold(evict, view) is not None
            time.sleep(lease_grace_s(view))
            assert health.hold(evict, view) is None
            leadership.resign()
        finally:
            etcd.close()
