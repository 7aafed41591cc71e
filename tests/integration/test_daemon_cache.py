"""The daemon's informer and cached view against a real etcd: the cache equals a fresh read
after random writes, deletes, transactions, lease revocations and compactions, one of which
forces a re-list; a view built from the cache equals one parsed from a snapshot and re-parses
only what changed; a burst of writes costs a bounded number of passes, but a report a decision waits for is
answered at once; and a pass right after the daemon's own write does not take its decision
again."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import threading
import time

from lazarus.core import etcd as E
from lazarus.core import jobspec
from lazarus.core.embedded_etcd import EmbeddedCluster
from lazarus.core.records import (RECOVERING, RUNNING, EventRecord, Keys, NodeRecord, NodeStatus,
                                  RoundRecord, RunStatus, dumps)
from lazarus.daemon.cache import Informer
from lazarus.daemon.service import Daemon
from lazarus.daemon.view import LiveView, parse, prefixes
from tests.bench.bench_view_cache import fleet, node_status


def _until(pred, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _random_changes(etcd: E.Etcd, keys: Keys, rng: random.Random, count: int) -> None:
    """Puts, deletes and transactions on a few keys of every kind the cache keeps, and on
    torchrun's store (under the root, not kept); some keys bound to a lease revoked at the
    end (its keys go at once, as when an agent's lease expires)."""
    lease = etcd.grant(300)  # revoked, never expiring while the test compares
    names = [f"n{i}" for i in range(8)]

    def key() -> str:
        name = rng.choice(names)
        return rng.choice([keys.node_key(name), keys.nodestatus_key(name), keys.cordon_key(name),
                           keys.drain_key(name), keys.root + f"torchrun/r/store/{name}",
                           f"{keys.events}{rng.randrange(20):020d}-t", keys.status])

    for _ in range(count):
        op = rng.random()
        if op < 0.5:
            etcd.put(key(), os.urandom(rng.randrange(1, 40)),
                     lease=lease if rng.random() < 0.3 else None)
        elif op < 0.75:
            etcd.delete(key())
        elif op < 0.95:  # several keys at one revision
            puts = {key() for _ in range(rng.randrange(1, 4))}
            deletes = {key() for _ in range(rng.randrange(0, 3))} - puts
            etcd.txn([], [E.put_op(k, os.urandom(8)) for k in sorted(puts)]
                     + [E.delete_op(k) for k in sorted(deletes)])
        else:
            etcd.delete(keys.cordon, prefix=True)
    etcd.revoke(lease)


def _same(informer: Informer, mirror: dict, sub, etcd: E.Etcd, keys: Keys) -> None:
    assert informer.wait_for(etcd.revision("/"), 10)
    fresh = etcd.snapshot(prefixes(keys))
    assert informer.snapshot().kvs == fresh.kvs
    _, changes = sub.drain()
    for k, kv in changes.items():
        if kv is None:
            mirror.pop(k, None)
        else:
            mirror[k] = kv
    assert mirror == fresh.kvs  # the change feed adds up to the same


def test_the_cache_equals_a_fresh_read_through_writes_compactions_and_a_relist(tmp_path):
    keys = Keys("/cache/")
    rng = random.Random(11)
    with EmbeddedCluster(tmp_path / "etcd") as cluster:
        # The informer talks to member 0 first; the writer never does.
        mine = E.Etcd(cluster.endpoint)
        writer = E.Etcd(",".join(m.endpoint for m in cluster.members[1:]))
        try:
            _random_changes(writer, keys, rng, 100)
            informer = Informer(mine, keys.root, prefixes(keys))
            sub = informer.subscribe()
            informer.start()
            mirror: dict = {}
            for _ in range(3):
                _random_changes(writer, keys, rng, 150)
                writer.compact(writer.revision("/"))  # a watch that keeps up is not disturbed
                _same(informer, mirror, sub, writer, keys)
            assert informer.lists == 1

            # The watch falls behind a compaction: its member freezes while the others go on,
            # then dies; the watch resumes on another member from a compacted revision.
            frozen = cluster.members[0].proc
            frozen.send_signal(signal.SIGSTOP)
            E.retry(lambda: _random_changes(writer, keys, rng, 150), deadline_s=30)
            writer.compact(writer.revision("/"))
            frozen.kill()
            frozen.wait()
            _until(lambda: informer.lists == 2, "the re-list")
            _same(informer, mirror, sub, writer, keys)
            _random_changes(writer, keys, rng, 100)  # and the watch goes on after it
            _same(informer, mirror, sub, writer, keys)
            informer.stop()
        finally:
            mine.close()
            writer.close()


def test_a_view_from_the_cache_equals_one_parsed_from_a_snapshot(etcd, keys):
    for key, value in fleet(64, keys).items():
        etcd.put(key, value)
    lease = etcd.grant(30)
    etcd.put(keys.leader, dumps({"id": "d0", "pid": 1, "host": "h"}), lease=lease)
    etcd.put(keys.drain_key("n00003"), dumps({"requested_at": 1.0}))
    etcd.put(keys.pause, dumps({"requested_at": 1.0}))
    etcd.put(keys.cancel, dumps({"requested_at": 1.0, "job_id": "J"}))
    etcd.put(keys.checkpoint_request, dumps({"id": "c1", "requested_at": 1.0}))
    etcd.put(keys.cordon_key("n00005"), b"drained")
    etcd.put(keys.nodestatus_key("n00007"), b"{not json")
    etcd.put(keys.nodestatus_key("n00008"), NodeStatus(node="n00009").to_json())  # wrong node
    etcd.put(f"{keys.events}{'9' * 20}-bad", b"[]")  # unreadable events are skipped

    def snapshot_view():
        return parse(etcd.snapshot(prefixes(keys)), keys)

    live = LiveView(etcd, keys)
    try:
        first = live.fresh(5)
        expected = snapshot_view()
        assert dataclasses.replace(first, revision=0) == dataclasses.replace(expected, revision=0)
        assert len(first.node_status) == 62 and set(first.ignored) == {
            keys.nodestatus_key("n00007"), keys.nodestatus_key("n00008")}
        assert first.leader.lease == lease and first.drains.keys() == {"n00003"}

        parsed = live.parsed
        for i in (1, 2, 3):
            etcd.put(keys.nodestatus_key(f"n{i:05d}"),
                     node_status(f"n{i:05d}", i, step=40).to_json())
        etcd.revoke(lease)                       # the leader's key goes with its lease
        etcd.delete(keys.node_key("n00004"))     # an agent gone
        etcd.put(keys.nodestatus_key("n00007"), node_status("n00007", 7).to_json())  # repaired
        etcd.delete(keys.cancel)
        second = live.fresh(5)
        assert live.parsed - parsed == 4         # what changed, not the 64 nodes' records
        expected = snapshot_view()
        assert dataclasses.replace(second, revision=0) == dataclasses.replace(expected,
                                                                              revision=0)
        assert second.node_status["n00001"].step == 40 and "n00004" not in second.nodes
        assert second.leader is None and not second.cancel_requested
        # a view already built is never changed under its reader
        assert first.node_status["n00001"].step == 20 and "n00004" in first.nodes
        assert live.current() is second          # nothing new: the same view
    finally:
        live.stop()


def test_a_burst_of_status_writes_costs_a_bounded_number_of_passes(etcd, keys):
    burst = 4096
    in_pass, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def on_pass(_leader: bool) -> None:
        seen.append(len(daemon.views.current().node_status))
        if len(seen) == 1:      # the first pass lasts as long as the burst (a slow pass)
            in_pass.set()
            release.wait(120)

    for first in range(0, burst, 128):  # registered: only then is a status its node's
        etcd.txn([], [E.put_op(keys.node_key(f"n{i:05d}"), NodeRecord(
            node=f"n{i:05d}", host="127.0.0.1", nproc=1).to_json())
                      for i in range(first, first + 128)])
    daemon = Daemon(etcd, keys, lease_ttl_s=5, tick_s=3600, min_pass_s=0.1, on_pass=on_pass,
                    compact_every_s=0)
    stop = threading.Event()
    loop = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    loop.start()
    try:
        assert in_pass.wait(30)
        last = 0
        for i in range(burst):
            last = etcd.put(keys.nodestatus_key(f"n{i:05d}"), NodeStatus(
                node=f"n{i:05d}", round=1, workers="running", step=i).to_json())
        assert daemon.views.informer.wait_for(last, 30)
        daemon.min_pass_s = 3600  # from now on, a change waits an hour for its pass
        release.set()
        _until(lambda: len(seen) == 2, "the pass after the burst")
        assert seen == [0, burst]  # one pass took in the whole burst
        for i in range(500):       # a second burst, within the rate limit: no pass at all
            last = etcd.put(keys.nodestatus_key(f"n{i:05d}"), NodeStatus(
                node=f"n{i:05d}", round=1, workers="running", step=burst + i).to_json())
        assert daemon.views.informer.wait_for(last, 30)
        assert daemon.views.current().node_status["n00499"].step == burst + 499
        assert daemon.passes == len(seen) == 2
    finally:
        release.set()
        stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive()


def test_a_pass_right_after_its_own_write_does_not_decide_it_again(etcd, keys):
    job = jobspec.from_dict({"job": {"name": "t", "nodes": 2, "min_nodes": 1,
                                     "nproc_per_node": 1, "id": "J"},
                             "train": {"steps": 1000, "model": {"name": "tiny"},
                                       "data": {"global_batch": 4}}}, source="test")
    etcd.put(keys.job, job.to_json())
    etcd.put(keys.accepted_job, job.to_json())
    etcd.put(keys.status, RunStatus(job_id="J", state=RUNNING, round=1, members=["n0", "n1"],
                                    since=time.time(), reason="running").to_json())
    etcd.put(keys.round_key(1), RoundRecord(round=1, job_id="J", members=["n0", "n1"],
                                            nproc_per_node=1, world_size=2, dp=2, tp=1,
                                            store_host="127.0.0.1", store_port=1).to_json())
    for n, role in (("n0", "active"), ("n1", "active"), ("n2", "spare")):
        etcd.put(keys.node_key(n), NodeRecord(node=n, host="127.0.0.1", nproc=1, role=role,
                                              store_port=1).to_json())
    degraded = {"gpu": {"state": "degraded", "reasons": ["ECC errors rising"]}}
    for n in ("n0", "n1"):
        etcd.put(keys.nodestatus_key(n), NodeStatus(
            node=n, round=1, workers="running", step=5,
            health=degraded if n == "n0" else {}).to_json())
    daemon = Daemon(etcd, keys, lease_ttl_s=5, tick_s=0.02, compact_every_s=0)
    # A watch that lags 50 ms behind etcd, as under load: the pass that follows the write
    # at once would see a view without it.
    intake, late = daemon.views.informer._on_events, []

    def lagging(events: list[E.Event]) -> None:  # on the etcd client's loop
        if not late:
            asyncio.get_running_loop().call_later(0.05, lambda: intake(late[:]) or late.clear())
        late.extend(events)
    daemon.views.informer._on_events = lagging
    stop = threading.Event()
    loop = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    loop.start()

    def swaps() -> list[EventRecord]:
        return [ev for kv in etcd.get_prefix(keys.events).kvs.values()
                if (ev := EventRecord.from_json(kv.value)).kind == "gpu_degraded"]
    try:
        _until(lambda: swaps(), "the planned swap")
        then = daemon.passes
        _until(lambda: daemon.passes >= then + 10, "ten passes more")
        assert len(swaps()) == 1  # the drain it asked for is in every later pass's view
        assert etcd.get(keys.drain_key("n0")) is not None
    finally:
        stop.set()
        loop.join(timeout=30)


def test_the_report_a_recovery_waits_for_is_answered_at_once_not_at_the_paced_rate(etcd, keys):
    """A worker crash: the surviving node's in-memory copies are known only from before the
    fault, so the recovery waits for its next report (daemon/rounds.py). That report is the
    whole of what the pass waits for: it must not also wait out min_pass_s (set to an hour)."""
    job = jobspec.from_dict({"job": {"name": "t", "nodes": 2, "min_nodes": 1,
                                     "nproc_per_node": 1, "id": "J"},
                             "train": {"steps": 1000, "model": {"name": "tiny"},
                                       "data": {"global_batch": 4}}}, source="test")
    now = time.time()
    etcd.put(keys.job, job.to_json())
    etcd.put(keys.accepted_job, job.to_json())
    # `since` ahead of the clock: the wait for a fresh report (tier0.FRESH_WAIT_S) cannot run
    # out under load before the report comes
    etcd.put(keys.status, RunStatus(
        job_id="J", state=RECOVERING, round=1, members=["n0", "n1"], since=now + 600,
        reason="worker crash", incident={"kind": "worker_crash", "culprit": "n1",
                                         "fault_at": now - 1, "detected_at": now - 1,
                                         "round": 1}).to_json())
    etcd.put(keys.round_key(1), RoundRecord(round=1, job_id="J", members=["n0", "n1"],
                                            nproc_per_node=1, world_size=2, dp=2, tp=1,
                                            store_host="127.0.0.1", store_port=1).to_json())
    for n in ("n0", "n1"):
        etcd.put(keys.node_key(n), NodeRecord(node=n, host="127.0.0.1", nproc=1, role="active",
                                              store_port=1).to_json())

    def copies(step: int) -> dict:
        return {"job": "J", "world": 2, "ranks": {"0": [step], "1": [step]}, "bytes": 1,
                "limit": 10}
    etcd.put(keys.nodestatus_key("n0"), NodeStatus(  # before the fault: out of date
        node="n0", round=1, workers="running", step=9, updated_at=now - 5,
        tier0=copies(8)).to_json())
    etcd.put(keys.nodestatus_key("n1"), NodeStatus(
        node="n1", round=1, workers="failed", step=10, updated_at=now, fault_at=now - 1,
        exit_codes={"0": -9}, failed_rank=1, tier0=copies(9)).to_json())
    daemon = Daemon(etcd, keys, lease_ttl_s=5, tick_s=3600, min_pass_s=3600, compact_every_s=0)
    stop = threading.Event()
    loop = threading.Thread(target=daemon.run, args=(stop,), daemon=True)
    loop.start()
    try:
        _until(lambda: "to report their in-memory copies" in daemon._last_reason,
               "the recovery to wait for n0")
        assert etcd.get(keys.round_key(2)) is None
        etcd.put(keys.nodestatus_key("n1"), NodeStatus(
            node="n1", round=1, workers="failed", step=10, updated_at=time.time(),
            fault_at=now - 1, exit_codes={"0": -9}, failed_rank=1,
            tier0=copies(9)).to_json())  # not the node waited for: no pass
        time.sleep(0.5)
        assert etcd.get(keys.round_key(2)) is None
        etcd.put(keys.nodestatus_key("n0"), NodeStatus(
            node="n0", round=1, workers="idle", step=10, updated_at=time.time(),
            tier0=copies(9)).to_json())
        _until(lambda: etcd.get(keys.round_key(2)) is not None, "round 2", timeout=20)
        record = RoundRecord.from_json(etcd.get(keys.round_key(2)).value)
        assert record.tier0["step"] == 9  # decided on the fresh report
    finally:
        stop.set()
        daemon.wake.set()
        loop.join(timeout=30)
