"""Replica mode's shard stores (docs/replicas.md): members[0]'s agent hosts a store per shard,
at most SHARD_STORES, for a replica epoch's cross-replica groups, and each rank finds its
shard's through the quorum's namespace -- so a replica's loss rebuilds every shard's group
on K loop threads, not on the quorum's one (docs/scale.md, "In replica mode")."""

from __future__ import annotations

import torch.distributed as dist

from lazarus.agent.ports import host_shard_stores
from lazarus.core.contract import SHARD_STORES
from lazarus.trainer.replicagroup import quorum_prefix, quorum_store, shard_store


def _agent_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_each_shard_finds_its_own_store_under_the_epochs_namespace():
    agent = _agent_store()
    hosted = host_shard_stores("127.0.0.1", agent, job_id="j", epoch=3, shards=4)
    assert len(hosted) == 4
    quorum = quorum_store("127.0.0.1", agent.port, "j", 3)
    for shard in range(8):  # shard s on the (s mod K)-th
        s = shard_store(quorum, "127.0.0.1", shard=shard, prefix=quorum_prefix("j", 3))
        s.set(f"from/{shard}", "1")
    assert [h.num_keys() for h in hosted] == [2, 2, 2, 2]
    # under the epoch's namespace: another epoch (a whole-world restart) never reads them
    assert not quorum_store("127.0.0.1", agent.port, "j", 4).check(["shard_stores"])


def test_a_wide_replica_shares_at_most_shard_stores_stores():
    agent = _agent_store()
    hosted = host_shard_stores("127.0.0.1", agent, job_id="j", epoch=1, shards=512)
    assert len(hosted) == SHARD_STORES
    assert len({h.port for h in hosted}) == SHARD_STORES
