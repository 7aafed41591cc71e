"""An agent's store is open to anyone on the network (docs/security.md): what a stranger
writes into it must not cost the agent more than a fixed few threads, nor keep a genuine
collective test from being served (lazarus.agent.collective_check.PeerTests)."""

from __future__ import annotations

import threading
import time

import pytest

from lazarus.agent import collective_check as coll

MiB = 1 << 20


@pytest.fixture
def agent():
    """A member's agent as the service builds it: its store, polled by its loop."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    serving = coll.PeerTests(store, host="127.0.0.1", port=store.port)
    done = threading.Event()

    def polling():
        while not done.is_set():
            serving.poll()
            time.sleep(0.05)

    loop = threading.Thread(target=polling, daemon=True)   # started by a test that wants it
    yield store, serving, loop
    done.set()


def stranger(store):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", store.port, is_master=False)


def test_a_million_requests_start_no_more_than_a_few_threads(agent):
    store, serving, _ = agent
    baseline = threading.active_count()
    stranger(store).add(coll.REQUESTS, 10**6)
    for _ in range(20):
        serving.poll()
        assert threading.active_count() <= baseline + coll.SERVING


def test_requests_with_valid_records_are_served_a_few_at_a_time(agent):
    store, serving, _ = agent
    attacker = stranger(store)
    baseline = threading.active_count()
    n = attacker.add(coll.REQUESTS, 50)
    for i in range(1, n + 1):   # valid records nobody will ever join
        attacker.set(f"lazarus/preflight/request/{i}", '{"bytes": 4}')
    for _ in range(10):
        serving.poll()
        assert threading.active_count() <= baseline + coll.SERVING


def test_after_a_flood_and_garbage_a_genuine_request_is_still_served(agent):
    store, serving, loop = agent
    attacker = stranger(store)
    attacker.add(coll.REQUESTS, 10**6)
    for _ in range(3):
        serving.poll()
    for n in range(10**6 + 1, 10**6 + 4):   # numbers taken ahead, with malformed records
        attacker.add(coll.REQUESTS, 1)
        attacker.set(f"lazarus/preflight/request/{n}", [b"{", b'{"bytes": "x"}',
                                                        b'{"bytes": 1e99}'][n % 3])
    serving.poll()
    attacker.set(coll.REQUESTS, "garbage")   # what an `add` cannot parse
    serving.poll()
    store.set("still", "mine")               # the agent's own connection lives on
    assert store.get("still") == b"mine"
    baseline = threading.active_count()
    loop.start()
    ok, reason = coll.with_peer("n0", "127.0.0.1", store.port, host="127.0.0.1",
                                nbytes=MiB, min_bus_gbps=0.0)
    assert ok and reason.startswith("gloo all-reduce of 1 MiB with n0: "), reason
    assert threading.active_count() <= baseline + coll.SERVING


@pytest.mark.parametrize("record, nbytes", [
    (b'{"bytes": 1048576}', MiB), (b'{"bytes": 1099511627776}', coll.MAX_PEER_BYTES),
    (b'{"bytes": 2}', None), (b'{"bytes": true}', None), (b'[4]', None), (b'\xff', None),
    (b'{"bytes": 4, "pad": "' + b"x" * 300 + b'"}', None)])
def test_request_records_are_judged_before_anything_is_started(record, nbytes):
    assert coll._requested_bytes(record) == nbytes
