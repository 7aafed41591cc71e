"""lazarus.core.eventfeed on a real etcd: each event is returned once, the first poll returns
what was there, the next ones only what came since, in pages when many came, and an event
that lands under a key older than one already returned (its writer's clock is behind) is
returned all the same."""

from __future__ import annotations

from lazarus.core import etcd as E
from lazarus.core.eventfeed import EventFeed
from lazarus.core.records import EventRecord

NS = 1_700_000_000_000_000_000


def _put(etcd, keys, ns: int, message: str, writer: str = "w") -> None:
    etcd.put(f"{keys.events}{ns:020d}-{writer}",
             EventRecord(time=ns / 1e9, kind="k", message=message).to_json())


def _said(feed: EventFeed) -> list[str]:
    return [ev.message for ev in feed.new_events()]


def test_each_event_once_what_was_there_first_then_what_came(etcd, keys):
    _put(etcd, keys, NS + 2, "b")
    _put(etcd, keys, NS + 1, "a")
    feed = EventFeed(etcd, keys)
    assert _said(feed) == ["a", "b"]
    assert _said(feed) == []
    _put(etcd, keys, NS + 3, "c")
    assert _said(feed) == ["c"]
    assert _said(feed) == []


def test_an_event_under_an_older_key_than_one_returned_is_returned(etcd, keys):
    feed = EventFeed(etcd, keys)
    _put(etcd, keys, NS + 10, "from the leader", "leader")
    assert _said(feed) == ["from the leader"]
    _put(etcd, keys, NS + 5, "from an agent whose clock is behind", "agent")
    assert _said(feed) == ["from an agent whose clock is behind"]


def test_since_leaves_out_the_events_dated_before_it(etcd, keys):
    _put(etcd, keys, NS - 1, "before")
    _put(etcd, keys, NS, "at")
    feed = EventFeed(etcd, keys, since_ns=NS)
    assert _said(feed) == ["at"]
    _put(etcd, keys, NS - 2, "before, written late")
    _put(etcd, keys, NS + 1, "after")
    assert _said(feed) == ["after"]


def test_many_new_events_come_in_pages_in_key_order(etcd, keys, monkeypatch):
    monkeypatch.setattr(E, "PAGE_KEYS", 2)  # and SAFE_PAGE_KEYS is 2: pages of two
    feed = EventFeed(etcd, keys)
    _put(etcd, keys, NS, "0")
    assert _said(feed) == ["0"]
    for i in (5, 1, 4, 2, 3):
        _put(etcd, keys, NS + i, str(i))
    assert _said(feed) == ["1", "2", "3", "4", "5"]
    assert _said(feed) == []


def test_a_value_that_is_no_event_is_skipped(etcd, keys):
    etcd.put(f"{keys.events}{NS:020d}-w", b"not json")
    _put(etcd, keys, NS + 1, "a")
    assert _said(EventFeed(etcd, keys)) == ["a"]


def test_events_too_large_for_one_answer_together_are_read_one_by_one(etcd, keys):
    feed = EventFeed(etcd, keys)
    big = "x" * (1400 << 10)  # under etcd's 1.5 MiB a value; three exceed a 4 MiB answer
    for i in range(3):
        _put(etcd, keys, NS + i, f"{i}{big}")
    _put(etcd, keys, NS + 3, "small")
    assert [m[:1] for m in _said(feed)] == ["0", "1", "2", "s"]
    assert _said(feed) == []
