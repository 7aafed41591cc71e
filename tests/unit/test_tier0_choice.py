"""Where a round restores from (lazarus.daemon.tier0) and who holds whose copies
(lazarus.agent.tier0_agent.ring_peer, lazarus.agent.tier0.Tier0Store): pure, table-driven."""

from __future__ import annotations

import pytest

from lazarus.agent.tier0 import Tier0Store
from lazarus.agent.tier0_agent import ring_peer
from lazarus.core.records import NodeStatus
from lazarus.daemon import tier0
from lazarus.daemon.tier0 import Tier0Choice


def held(ranks: dict[int, list[int]], *, job: str = "j", world: int = 4) -> dict:
    return {"job": job, "world": world, "ranks": {str(r): s for r, s in ranks.items()},
            "bytes": 1, "limit": 10}


def choose(holdings, members=("a", "b"), nproc=2, world=4):
    return tier0.newest_in_memory(holdings, job_id="j", world_size=world,
                                  members=list(members), nproc=nproc)


def test_a_crash_restores_each_rank_from_its_own_node():
    # a holds its ranks 0,1 and b's copies (2,3); b holds 2,3 and a's
    h = {"a": held({0: [8, 7], 1: [8, 7], 2: [7, 6], 3: [7, 6]}),
         "b": held({2: [8, 7], 3: [8, 7], 0: [8, 7], 1: [8, 7]})}
    assert choose(h) == Tier0Choice(8, {0: "a", 1: "a", 2: "b", 3: "b"})


def test_a_lost_nodes_ranks_come_from_its_peer_for_the_spare_in_its_place():
    # b is gone; spare s runs ranks 2,3; a holds b's copies
    h = {"a": held({0: [12, 11], 1: [12, 11], 2: [11, 10], 3: [11, 10]}),
         "s": {}}
    assert choose(h, members=("a", "s")) == Tier0Choice(11, {0: "a", 1: "a", 2: "a", 3: "a"})


def test_a_copy_lost_with_its_peer_leaves_no_step_in_memory():
    h = {"s1": {}, "s2": {}, "c": held({0: [9], 1: [9]})}
    assert choose(h, members=("s1", "s2")) is None


@pytest.mark.parametrize("garbage", [
    None, [], "x", {"job": "other", "world": 4, "ranks": {"0": [5], "1": [5], "2": [5], "3": [5]}},
    {"job": "j", "world": 2, "ranks": {"0": [5], "1": [5], "2": [5], "3": [5]}},
    {"job": "j", "world": 4, "ranks": {"0": [5, True, -1, "7"], "x": [5], "9": [5]}},
    {"job": "j", "world": 4, "ranks": []}])
def test_copies_of_another_job_or_mesh_and_garbage_count_for_nothing(garbage):
    h = {"a": held({0: [5], 1: [5], 2: [5]}), "b": garbage}
    assert choose(h) is None


@pytest.mark.parametrize("t0, t1, failed, want", [
    (8, 4, False, 8),       # memory is newer
    (8, 8, False, 8),       # as new: memory is faster
    (8, 12, False, None),   # storage is newer
    (8, None, False, 8),    # nothing on storage yet
    (8, 4, True, None),     # a restore from memory just failed: storage
    (None, 4, False, None),
])
def test_the_newest_step_wins_in_either_tier(t0, t1, failed, want):
    choice = Tier0Choice(t0, {0: "a"}) if t0 else None
    got = tier0.choose(tier0=choice, tier1_step=t1, tier0_failed=failed)
    assert (got.step if got else None) == want


def test_a_failed_restore_from_memory_is_recognised_by_its_incident():
    label = Tier0Choice(17, {}).label
    assert tier0.failed_before({"kind": "bad_checkpoint", "culprit": label})
    assert not tier0.failed_before({"kind": "bad_checkpoint", "culprit": "/ckpt/step-00000016"})
    assert not tier0.failed_before({"kind": "worker_crash", "culprit": label})
    assert not tier0.failed_before(None)


def test_only_holders_that_reported_before_the_fault_are_waited_for():
    assert tier0.stale({"a": (10.0, True), "b": (12.0, True), "c": (5.0, False)}, 11.0) == ["a"]


def test_the_node_status_carries_the_holdings_and_reads_them_back():
    status = NodeStatus(node="a", tier0=held({0: [3]}))
    assert NodeStatus.from_json(status.to_json(), "nodestatus/a").tier0 == held({0: [3]})


@pytest.mark.parametrize("members, node, peer", [
    (["a", "b", "c"], "a", "b"), (["a", "b", "c"], "c", "a"), (["a", "b"], "b", "a"),
    (["a"], "a", None), (["a", "b"], "spare", None)])
def test_each_member_sends_its_copies_to_the_next_one_in_a_ring(members, node, peer):
    assert ring_peer(members, node) == peer


def test_the_store_keeps_the_newest_and_the_promised_steps_within_its_limit(tmp_path):
    store = Tier0Store(tmp_path / "t0", limit_bytes=1000, keep=2)

    def add(step, size=100):
        f = store.incoming / f"r0-{step}"
        f.write_bytes(b"x" * size)
        store.add_local("j", 0, step, f)

    add(1)
    add(2)
    assert store.holdings("j", 1)["ranks"] == {"0": [2, 1]}  # promised to the daemon now
    add(3)
    add(4)
    # 1 and 2 were promised: kept past `keep` until a newer report replaces the promise
    assert sorted(c for c in (1, 2, 3, 4) if store.path("j", 0, c)) == [1, 2, 3, 4]
    assert store.holdings("j", 1) == {"job": "j", "world": 1, "ranks": {"0": [4, 3]},
                                      "bytes": 400, "limit": 1000}
    add(5)
    assert sorted(c for c in range(1, 6) if store.path("j", 0, c)) == [3, 4, 5]
    add(6, size=950)  # past the limit: the oldest go, promised or not
    assert [c for c in range(1, 7) if store.path("j", 0, c)] == [6]
    assert store.used_bytes() == 950
    store.add_replica("j", 1, 6, b"y" * 50)
    store.forget(job="j", after_step=5)
    assert store.used_bytes() == 0


def test_own_copies_are_kept_back_to_the_step_the_peers_replicas_reached(tmp_path):
    """A lost peer's ranks restore from their replicas here, with this node's own copies of
    the same step: while the replicas lag, the own copies back to them stay (and are named
    in the status), beyond the `keep` newest."""
    store = Tier0Store(tmp_path / "t0", limit_bytes=10_000, keep=2)

    def add(step):
        f = store.incoming / f"r0-{step}"
        f.write_bytes(b"x" * 100)
        store.add_local("j", 0, step, f)

    store.add_replica("j", 1, 3, b"y" * 100)  # the peer's rank 1 as of step 3
    for step in range(1, 8):
        add(step)
    assert store.holdings("j", 2)["ranks"] == {"0": [7, 6, 5, 4, 3], "1": [3]}
    store.add_replica("j", 1, 6, b"y" * 100)
    store.sent("j", 0, 6)
    add(8)
    held = store.holdings("j", 2)["ranks"]
    assert held == {"0": [8, 7, 6], "1": [6, 3]}
    add(9)  # the promise of 3..5 replaced: only what the ring still needs stays
    assert [s for s in range(1, 10) if store.path("j", 0, s)] == [6, 7, 8, 9]
