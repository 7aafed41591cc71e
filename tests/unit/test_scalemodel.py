"""The scale model (tests/bench/scalemodel.py, docs/scale.md): a prediction is the arithmetic
of its laws, the replica mode's included, and the whole-world figures docs/scale.md and the
README print are what the model still says."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lazarus.core import contract, settings
from lazarus.trainer import quorum, replicagroup, replicaloop
from tests.bench import scalemodel as sm
from tests.bench import storeload

STORE = sm.fit_store(list(sm.STORE_MEASURED))


def part(pred: sm.Prediction, name: str) -> float:
    (seconds,) = [p.seconds for p in pred.parts if p.name == name]
    return seconds


def test_whole_world_predictions_are_the_ones_docs_print():
    # docs/scale.md's table and README's "model" row: 2.9 / 12.5 / 554 s, a node lost 5 s more
    for ranks, crash in ((1024, 2.9), (16384, 12.5), (131072, 553.6)):
        assert sm.predict(ranks, kind="worker_crash", store=STORE).total == pytest.approx(
            crash, abs=0.05)
        assert sm.predict(ranks, kind="node_lost", store=STORE).total == pytest.approx(
            crash + sm.LEASE_TTL_S, abs=0.05)
    assert sm.predict(131072, kind="worker_crash", store=STORE).dominant().name == (
        "process groups")


def test_a_communicators_unique_ids_are_n_squared_bytes_from_the_store():
    # torch's scalable NCCL init: up to 128 ranks one id (broadcast, not counted), past it
    # every rank reads ceil(N / 128) ids of 128 bytes
    assert sm.id_bytes(128) == 0
    assert sm.id_bytes(129) == 129 * 2 * 128
    assert sm.id_bytes(131072) == 131072 * 1024 * 128  # 17 GB a communicator
    # the fit takes the connects out: synthetic points of 1 ms a connect, 1 ns a byte
    ids = sm.fit_ids([(n, sm.id_bytes(n), 1e-3 * n + 1e-9 * sm.id_bytes(n))
                      for n in (1024, 4096, 16384)])
    assert ids(131072) == pytest.approx(1e-9 * sm.id_bytes(131072))
    assert part(sm.predict(131072, kind="worker_crash", store=STORE), "communicator ids") == (
        pytest.approx(sm.IDS(131072)))
    # measured here, the store sends ids at some hundreds of MB/s: tens of seconds at 131,072
    assert 10 < sm.IDS(131072) < 200


def test_the_ids_load_reads_what_the_formula_counts():
    # the load's steps on an in-process store (the bench's go over TCP): each root publishes
    # its id, every rank waits for all of them
    store, world, read = dist.HashStore(), 257, []  # three roots: ranks 0, 128 and 256
    store.set_timeout(timedelta(seconds=60))
    threads = [threading.Thread(target=lambda r=r: read.append(
        storeload.nccl_ids(store, r, world))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(read) == sm.id_bytes(world) and set(read) == {3 * 128}


def test_the_model_copies_the_codes_constants():
    # the model does not import torch; these are the values the code runs with
    assert sm.LEASE_TTL_S == settings.LEASE_TTL_S
    assert sm.RETRY_GRACE_S == quorum.RETRY_GRACE_S
    assert sm.LOOK_S == quorum.LOOK_S
    assert sm.QUORUM_WAIT_S == replicaloop.QUORUM_WAIT_S
    assert sm.SILENCE_CHECK_S == replicagroup.SILENCE_CHECK_S
    assert sm.SHARD_STORES == contract.SHARD_STORES


def test_a_crash_in_replicas_of_512_at_16384_is_its_laws():
    p = sm.predict_replica(16384, kind="worker_crash", store=STORE, replica_gpus=512)
    per_request = STORE(16384) / (16384 * 5)
    assert p.replicas == 32
    # one decision: each of the 32 leaders arrives, counts itself in, waits and reads the
    # answer; the last checks every arrival at once, reads the floor and decides
    # (trainer/quorum.py)
    assert p.quorum_s == pytest.approx((4 * 32 + 3) * per_request)
    assert part(p.stall, "the retry's quorum") == pytest.approx(0.5 + p.quorum_s)
    # the live ranks publish and read 3 of the rendezvous law's 5 operations each, spread
    # over 16 shard stores: 512 shards, 32 a store, each a group of the 31 live replicas
    assert part(p.stall, "cross-replica groups, rendezvous") == pytest.approx(
        STORE(32 * 31) * 3 / 5)
    # the restarted replica's rendezvous queues behind the retry's quorum only
    arrive = sm.DETECT_CRASH_S + part(p.back, "decide") + sm.REPLICA_START_S
    assert part(p.back, "rendezvous") == pytest.approx(
        max(arrive, 0.5 + p.quorum_s) + STORE(512) + sm.IDS(512) - arrive)
    # a group of 32 members, and the failed replica's world of 512: both at the floor
    assert part(p.stall, "cross-replica groups, communicators") == sm.NCCL_FLOOR_S
    assert part(p.back, "process groups") == sm.NCCL_FLOOR_S
    # 405e9 parameters x 16 bytes over 512 ranks, 4 GB/s a pair
    assert part(p.back, "heal") == pytest.approx(405e9 * 16 / 512 / 4e9)
    assert part(p.back, "detect") == sm.DETECT_CRASH_S
    assert p.stall.total < p.back.total
    # every GPU for the two stalls, and 1/32 of them while the replica is away in between
    assert p.lost_s == pytest.approx(
        p.stall.total + p.rejoin.total + (p.back.total - p.stall.total) / 32)
    whole = sm.predict(16384, kind="worker_crash", store=STORE)
    assert sm.replica_ettr(p, sm.MTBF_S[16384]) == pytest.approx(
        sm.MTBF_S[16384] / (sm.MTBF_S[16384] + p.lost_s))
    assert p.stall.total < whole.total


def test_what_dominates_at_131072_depends_on_the_replicas_size():
    # the live ranks' rebuild of their cross-replica groups, spread over the shard stores,
    # stays under a second; the live replicas wait on the communicators' floor, and the
    # failed replica's return on its heal (the quorum, linear in R, is a fraction of a second
    # even at 1,024 replicas)
    small = sm.predict_replica(131072, kind="worker_crash", store=STORE, replica_gpus=128)
    mid = sm.predict_replica(131072, kind="worker_crash", store=STORE, replica_gpus=512)
    for p in (small, mid):
        assert p.stall.dominant().name == "cross-replica groups, communicators"
        assert part(p.stall, "cross-replica groups, rendezvous") < 1.0
        assert p.back.dominant().name == "heal"
    assert small.quorum_s < 0.5
    # on one store, as built before the shard stores, the rebuild was every live rank's
    assert part(mid.stall, "cross-replica groups, rendezvous") < STORE(131072 - 512) * 3 / 5 / 10
    # a replica big enough that its own communicators leave the floor
    big = sm.predict_replica(131072, kind="worker_crash", store=STORE, replica_gpus=16384)
    assert part(big.back, "process groups") == pytest.approx(265.0 * (16384 / 98304) ** 2)
    assert big.back.dominant().name == "process groups"
    # whatever the size, far below every rank of the world rebuilding
    whole = sm.predict(131072, kind="worker_crash", store=STORE).total
    assert max(p.stall.total for p in (small, mid, big)) < whole / 4


def test_a_silent_node_costs_the_live_replicas_its_leaders_silence():
    crash = sm.predict_replica(16384, kind="worker_crash", store=STORE, replica_gpus=512)
    node = sm.predict_replica(16384, kind="node_lost", store=STORE, replica_gpus=512)
    assert node.stall.total == pytest.approx(crash.stall.total + sm.REPLICA_SILENT_S)
    assert part(node.back, "detect") == sm.LEASE_TTL_S + sm.DETECT_CRASH_S
    # the failed replica is let back in only once the live ones are past their stall
    assert node.back.total > node.stall.total
    told = sm.predict_replica(16384, kind="node_lost", store=STORE, replica_gpus=512,
                              silent_seen_s=7.0)
    assert told.stall.total == pytest.approx(crash.stall.total + 7.0)


@pytest.mark.parametrize("ranks, replica_gpus", [(1024, 1024), (1024, 384), (1024, 0)])
def test_a_replica_size_that_does_not_split_the_world_is_refused(ranks, replica_gpus):
    with pytest.raises(ValueError, match="replicas of"):
        sm.predict_replica(ranks, kind="worker_crash", store=STORE, replica_gpus=replica_gpus)


def test_the_tables_print_every_size():
    table = sm.replica_table(STORE, 512)
    assert table.count("\n") > 20 and "| replicas | 2 | 32 | 256 |" in table
    # a replica as big as the smallest world is no replica mode there
    assert "| replicas | - | 8 | 64 |" in sm.replica_table(STORE, 2048)
    assert sm.replica_sizes_table(STORE).count("\n") == 5
