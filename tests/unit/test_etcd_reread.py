"""A read in pages at one revision that etcd compacts away between two pages is read again at
a newer revision, a bounded number of times (lazarus.core.etcd.reread_if_compacted: the
snapshot and the event feed's polls); past them the caller hears EtcdCompacted."""

from __future__ import annotations

import pytest

from lazarus.core import etcd as E


def _read_compacted(times: int):
    calls = []

    def read():
        calls.append(None)
        if len(calls) <= times:
            raise E.EtcdCompacted("required revision has been compacted")
        return "read whole"
    return read, calls


def test_a_read_compacted_under_it_is_read_again():
    read, calls = _read_compacted(2)
    assert E.reread_if_compacted(read, times=2) == "read whole"
    assert len(calls) == 3


def test_past_its_rereads_the_compaction_is_raised():
    read, calls = _read_compacted(3)
    with pytest.raises(E.EtcdCompacted):
        E.reread_if_compacted(read, times=2)
    assert len(calls) == 3


def test_other_failures_are_not_read_again():
    calls = []

    def read():
        calls.append(None)
        raise E.EtcdUnavailable("no member answered")
    with pytest.raises(E.EtcdUnavailable):
        E.reread_if_compacted(read, times=2)
    assert len(calls) == 1
