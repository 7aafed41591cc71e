"""A client keeps working when etcd forgets its authentication token: a restart of etcd
(tokens live in its memory) or a token that idled past --auth-token-ttl. Calls, lease
keep-alives and watches all go on, old watches and new ones alike."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedEtcd
from lazarus.core.etcd_rbac import DAEMON_USER
from lazarus.core.records import Keys
from tests.integration.polling import until

KEYS = Keys()


def _key(name: str) -> str:
    return KEYS.events + name


class Seen:
    """The keys a watch delivered."""

    def __init__(self):
        self.keys: set[str] = set()
        self._changed = threading.Condition()

    def __call__(self, events: list[E.Event]) -> None:
        with self._changed:
            self.keys.update(e.kv.key for e in events)
            self._changed.notify_all()

    def wait_for(self, key: str, what: str) -> None:
        with self._changed:
            # generous: the machine is shared; a watch that is dead never delivers at all
            assert self._changed.wait_for(lambda: key in self.keys, 20), what


def _watch_streams_opened(server: EmbeddedEtcd) -> int:
    """Watch streams opened on this etcd process since it started (its own metrics)."""
    with urllib.request.urlopen(server.metrics_url, timeout=2) as resp:
        text = resp.read().decode()
    found = re.search(r'^grpc_server_started_total\{grpc_method="Watch"[^}]*\} (\d+)', text,
                      re.MULTILINE)
    return int(found.group(1)) if found else 0


@pytest.fixture
def server(tmp_path):
    with EmbeddedEtcd(tmp_path / "etcd", secure=True) as server:
        yield server


def test_a_client_outlives_a_restart_of_etcd_with_authentication_on(server):
    client = E.Etcd(server.endpoint, auth=server.auth(DAEMON_USER))
    seen = Seen()
    try:
        E.retry(lambda: client.put(_key("before"), b"{}"), deadline_s=30)
        watch = client.watch_prefix(KEYS.events, start_revision=1, on_events=seen)
        seen.wait_for(_key("before"), "the watch delivered nothing")
        # keep-alives every 10 s: none in the window below, where only the watch may talk
        session = E.Session(client, ttl_s=30)

        server.stop()
        server.start()
        # The watch opens its stream again before anything else of the client's talks to
        # etcd, with the token etcd no longer knows: the create of the watch on it is refused
        # (the case that once left the daemon's informer silent for ever).
        until(lambda: _watch_streams_opened(server) > 0, "the watch to watch again")

        E.retry(lambda: client.put(_key("after"), b"{}"), deadline_s=30)
        assert client.get(_key("after")).value == b"{}"
        seen.wait_for(_key("after"), "the watch delivered nothing after the restart")
        assert client.refresh(session.lease) > 0  # the keep-alive's own call
        assert not session.lost.is_set()
        late = Seen()
        client.watch_prefix(KEYS.events, start_revision=client.revision(KEYS.root) + 1,
                            on_events=late)
        client.put(_key("late"), b"{}")
        late.wait_for(_key("late"), "a watch created after the restart delivered "
                      "nothing")
        session.close()
        watch.cancel()
    finally:
        client.close()


def test_a_client_idle_past_the_token_ttl_still_watches_and_writes(tmp_path):
    ttl_s = 2
    with EmbeddedEtcd(tmp_path / "etcd", secure=True, auth_token_ttl_s=ttl_s) as server:
        client = E.Etcd(server.endpoint, auth=server.auth(DAEMON_USER))
        old = Seen()
        try:
            start = E.retry(lambda: client.revision(KEYS.root), deadline_s=30) + 1
            client.watch_prefix(KEYS.events, start_revision=start, on_events=old)
            client.put(_key("first"), b"{}")
            old.wait_for(_key("first"), "the watch delivered nothing")
            token = dict(client._client.metadata)["token"]
            # etcd drops an idle token about a second after its TTL, when its sweep gets to
            # it: on a loaded machine later. A put that finds the token still known uses it,
            # which restarts its TTL, so the wait starts over.
            for _ in range(4):
                time.sleep(ttl_s + 2.5)
                client.put(_key("idle"), b"{}")
                if dict(client._client.metadata)["token"] != token:
                    break
            assert dict(client._client.metadata)["token"] != token, "etcd still knew the token"
            old.wait_for(_key("idle"), "the watch created before the token expired "
                         "delivered nothing after")
            new = Seen()
            client.watch_prefix(KEYS.events, start_revision=client.revision(KEYS.root) + 1,
                                on_events=new)
            client.put(_key("new"), b"{}")
            new.wait_for(_key("new"), "a watch created after the token expired "
                         "delivered nothing")
        finally:
            client.close()
