"""Tier-0 copies between agents over real TCP (lazarus.agent.replica): a holder of the shared
key sends and fetches shards; anyone else, and any damaged shard, is refused; the sender
says when each copy is on its peer."""

from __future__ import annotations

import time

import pytest

from lazarus.agent import replica
from lazarus.agent.tier0 import Tier0Store
from lazarus.agent.tier0_agent import Tier0, Tier0Options
from lazarus.core.records import NodeRecord, RoundRecord
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


def test_each_snapshot_is_settled_once_it_is_on_the_peer_or_never_will_be(tmp_path):
    """What a rank's tier-0 stall line times (durable_s): the agent says when its peer holds
    the copy, or that it never will (overtaken by a newer one before it was sent)."""
    settled: dict[str, list] = {"n0": [], "n1": []}
    agents: dict[str, Tier0] = {}

    def lookup(node):
        return NodeRecord(node=node, host="127.0.0.1", nproc=1, replica_port=agents[node].port)

    for node in ("n0", "n1"):
        agents[node] = Tier0(node=node, host="127.0.0.1", lookup=lookup,
                             options=Tier0Options(tmp_path / node, 1 << 20, KEY),
                             on_kept=lambda r, s, ok, node=node: settled[node].append((r, s, ok)))
    rec = RoundRecord(round=2, job_id="j", members=["n0", "n1"], nproc_per_node=1,
                      world_size=2, dp=2, tp=1, store_host="127.0.0.1", store_port=1)
    try:
        for a in agents.values():
            a.round_seen(rec)
        n0 = agents["n0"]
        with n0._cv:  # hold the sender: the next two wait in the outbox, the second overtakes
            for step in (5, 6):
                f = n0.store.incoming / f"s{step}.t0"
                f.write_bytes(shard(step=step, rank=0))
                n0.taken("j", {"rank": 0, "step": step, "path": str(f)})
        deadline = time.monotonic() + 10
        while len(settled["n0"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert settled["n0"] == [(0, 5, False), (0, 6, True)]
        assert agents["n1"].store.path("j", 0, 6) is not None  # on the peer when it said so
    finally:
        for a in agents.values():
            a.close()


def test_a_shard_altered_on_the_way_is_refused_whatever_digest_it_carries(peer):
    """The seal covers the header and the file's own digest, and the file must match that
    digest: a body changed in transit fails one or the other."""
    import hashlib
    import json
    import os
    import socket
    import time

    server, store, taken = peer
    good = shard()
    altered = bytearray(good[:-32])
    altered[60] ^= 1
    header = {"op": "put", "from": "n0", "job": "j", "rank": 1, "step": 5, "round": 2}
    for body in (bytes(altered) + good[-32:],                                  # digest kept
                 bytes(altered) + hashlib.sha256(bytes(altered)).digest()):    # redone
        # addressed as the protocol asks (protocol 4): refused for its body, not its header
        head = json.dumps({**header, "to": server.node, "port": server.port,
                           "nonce": os.urandom(16).hex(), "time": time.time()},
                          sort_keys=True).encode()
        # sealed for the original
        seal = replica.sealed.tag(KEY, replica._context(head, len(good), good[-32:]))
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(len(head).to_bytes(4, "big") + head + len(body).to_bytes(8, "big")
                         + good[-32:] + seal + body)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1 << 16)
    assert taken == [] and store.used_bytes() == 0
    put(server)  # the original, as sealed, is taken
    assert taken == [("j", 1, 5)]
