"""Tier-0 copies between agents over real TCP (lazarus.agent.replica): a holder of the shared
key sends and fetches shards; anyone else, and any damaged shard, is refused."""

from __future__ import annotations

import pytest

from lazarus.agent import replica
from lazarus.agent.tier0 import Tier0Store
from lazarus.core import snapshotfile

KEY = b"k" * 32


def shard(step: int = 5, rank: int = 1) -> bytes:
    return snapshotfile.pack({"job": "j", "round": 2, "rank": rank, "world_size": 2,
                              "step": step}, b"tensors" * 100)


@pytest.fixture
def peer(tmp_path):
    store = Tier0Store(tmp_path / "t0", limit_bytes=1 << 20)
    taken = []

    def accept(job, rank, step, data, round_):
        if round_ < 2:
            raise replica.ReplicaError(f"a copy of round {round_}")
        taken.append((job, rank, step))
        store.add_replica(job, rank, step, data)

    server = replica.ReplicaServer("127.0.0.1", key=KEY, accept=accept, find=store.path,
                                   max_bytes=1 << 20)
    yield server, store, taken
    server.close()


def put(server, key=KEY, data=None, **kw):
    args = {"node": "n0", "job": "j", "rank": 1, "step": 5, "round_": 2, **kw}
    replica.push("127.0.0.1", server.port, key, data=shard() if data is None else data, **args)


def test_a_key_holder_sends_a_shard_and_the_spare_fetches_it_back(peer):
    server, store, taken = peer
    put(server)
    assert taken == [("j", 1, 5)]
    got = replica.fetch("127.0.0.1", server.port, KEY, node="s0", job="j", rank=1, step=5,
                        max_bytes=1 << 20)
    assert got == shard()
    with pytest.raises(replica.ReplicaError, match="no copy of rank 1 step 6"):
        replica.fetch("127.0.0.1", server.port, KEY, node="s0", job="j", rank=1, step=6,
                      max_bytes=1 << 20)


def test_without_the_key_nothing_is_taken_nor_given(peer):
    server, store, taken = peer
    with pytest.raises(replica.ReplicaError):
        put(server, key=b"x" * 32)
    assert taken == [] and store.used_bytes() == 0
    put(server)
    with pytest.raises(replica.ReplicaError):
        replica.fetch("127.0.0.1", server.port, b"x" * 32, node="s0", job="j", rank=1, step=5,
                      max_bytes=1 << 20)


def test_a_damaged_or_misnamed_shard_is_refused(peer):
    server, store, taken = peer
    damaged = bytearray(shard())
    damaged[40] ^= 1
    with pytest.raises(replica.ReplicaError, match="sha256 checksum"):
        put(server, data=bytes(damaged))
    with pytest.raises(replica.ReplicaError):
        put(server, step=6)  # a step-5 shard sent as step 6
    with pytest.raises(replica.ReplicaError, match="round 1"):
        put(server, round_=1)  # sent before the sender saw the round this node is in
    assert taken == []
