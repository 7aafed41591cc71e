"""Reads of a real etcd never exceed the client's receive limit, whatever the keyspace holds
(lazarus.core.etcd: snapshots paged at one revision; docs/security.md, "The job's own code"):
values near etcd's own 1.5 MiB limit under one prefix, more of them than one answer holds,
read back whole; a refused answer costs a read one or two round trips, not a lasting slowdown
of every read after it."""

from __future__ import annotations

import pytest

from lazarus.core import etcd as E

MiB = 1 << 20
# Near etcd's --max-request-bytes (1.5 MiB, the key and the put's framing included).
BIG = (3 << 19) - 4096


@pytest.fixture
def calls(etcd, monkeypatch):
    """The Range and Txn calls made, each as (method, refused for its size)."""
    made: list[tuple[str, bool]] = []
    real = etcd._unary

    async def counted(client, stub, method, request):
        try:
            answer = await real(client, stub, method, request)
        except Exception as e:
            made.append((method, isinstance(E.classify(e, etcd.member, etcd.auth),
                                            E.EtcdTooLarge)))
            raise
        made.append((method, False))
        return answer

    monkeypatch.setattr(etcd, "_unary", counted)
    return made


def test_values_larger_in_all_than_an_answer_are_read_whole_at_one_revision(etcd, keys,
                                                                              calls):
    big = {f"{keys.events}e{i}": bytes([65 + i]) * BIG for i in range(6)}  # 9 MiB
    for k, v in big.items():
        etcd.put(k, v)
    etcd.put(keys.status, b"{}")
    assert sum(len(v) for v in big.values()) > 2 * E.MAX_RECEIVE
    try:
        for read in range(2):
            calls.clear()
            snap = etcd.snapshot([keys.events, keys.status])
            assert {k: kv.value for k, kv in snap.kvs.items()} == {**big, keys.status: b"{}"}
            assert max(kv.mod_revision for kv in snap.kvs.values()) <= snap.revision
            refused = sum(r for _, r in calls)
            # the first read learns what the prefix holds; the next one is sized by it
            assert refused <= (2 if read == 0 else 0), calls
        assert {k: kv.value for k, kv in etcd.get_prefix(keys.events).kvs.items()} == big
    finally:
        etcd.delete(keys.root, prefix=True)


def test_a_prefix_of_large_values_does_not_slow_the_reads_of_others(etcd, keys, calls):
    for i in range(4):
        etcd.put(f"{keys.events}e{i}", b"x" * BIG)
    small = [f"{keys.nodestatus}n{i:04d}" for i in range(3000)]
    for i in range(0, len(small), 100):
        etcd.txn([], [E.put_op(n, b"{}") for n in small[i:i + 100]])
    try:
        assert len(etcd.get_prefix(keys.events).kvs) == 4
        calls.clear()
        assert len(etcd.get_prefix(keys.nodestatus).kvs) == len(small)
        assert len(calls) <= 4, calls  # pages of 1,000, not one key at a time
        # one large value among them: the next read starts with small pages, which grow back
        etcd.put(f"{keys.nodestatus}n0000", b"x" * BIG)
        for _ in range(2):
            calls.clear()
            assert len(etcd.get_prefix(keys.nodestatus).kvs) == len(small)
            assert len(calls) <= 20 and not any(r for _, r in calls[1:]), calls
    finally:
        etcd.delete(keys.root, prefix=True)
