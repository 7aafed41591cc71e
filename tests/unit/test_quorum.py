"""The per-step quorum's leaders on a real TCPStore, a thread and a connection each
(lazarus.trainer.quorum): every leader gets the same answer; a step that every member
reaches costs a number of store requests linear in the replicas (every leader polling every
replica's keys cost R(2R + 3), 5.3 s a step at 256 replicas, docs/scale.md); a silent member
is left out, a joiner let in, a retry goes on without the member that broke the step."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from lazarus.trainer import quorum as qm
from lazarus.trainer.quorum import QuorumClient
from lazarus.trainer.replicagroup import mark_left


class Counted:
    """A store connection that records the requests made through it: (method, keys)."""

    def __init__(self, store: dist.Store):
        self._store, self.log = store, []

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            keys = args[0] if args and isinstance(args[0], list) else args[:1]
            self.log.append((name, tuple(keys)))
            return method(*args, **kwargs)
        return counted


def _of_others(client: QuorumClient) -> list:
    """The requests a leader made that read or wrote another replica's keys."""
    mine = f"/{client.replica}"
    return [(m, keys) for m, keys in client.store.log
            if any(k.split("/")[0] in ("in", "join", "hb", "left", "incarnation")
                   and not k.endswith(mine) for k in keys)]


@pytest.fixture
def server():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


def _client(server, replica: int, replicas: int, **kw) -> QuorumClient:
    conn = Counted(dist.PrefixStore("q/", dist.TCPStore("127.0.0.1", server.port,
                                                         is_master=False,
                                                         wait_for_workers=False)))
    opts = {"min_replicas": 1, "wait_s": 1.0, "start_wait_s": 2.0, "timeout_s": 30.0, **kw}
    return QuorumClient(conn, replica=replica, replicas=replicas, **opts)


def _ask_all(clients, step, attempt, expected, delays=None):
    def one(c):
        time.sleep((delays or {}).get(c.replica, 0.0))
        return c.ask(step, attempt, expected)
    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(one, clients))


@pytest.mark.parametrize("replicas", [4, 24])
def test_a_step_every_member_reaches_costs_requests_linear_in_the_replicas(server, replicas,
                                                                           monkeypatch):
    # a thread held back a second by a busy machine would make the watcher look: the count
    # is of the requests a step makes, not of a machine's load
    monkeypatch.setattr(qm, "LOOK_S", 60.0)
    clients = [_client(server, r, replicas) for r in range(replicas)]
    everyone = set(range(replicas))
    _ask_all(clients, 0, 0, everyone)  # connections warm
    for c in clients:
        c.store.log.clear()
    # arrivals spread over 50 ms, as the members' step times differ
    got = _ask_all(clients, 1, 0, everyone, {r: 0.05 * r / replicas for r in everyone})
    assert {q.to_json() for q in got} == {got[0].to_json()}
    assert got[0].members == tuple(range(replicas)) and got[0].healing == ()
    # no leader reads another replica's keys, but the last to arrive, which checks all their
    # arrivals in one request and decides
    others = [r for c in clients for r in _of_others(c)]
    assert len(others) == 1 and others[0][0] == "check" and len(others[0][1]) == replicas, others
    # each leader: its arrival, its count, a wait and a read of the answer (the decider: the
    # check and the decision; the watcher: its name); beside them only the watcher's looks
    # at the answer and the news, two a POLL_S while it waits
    looks = [(m, k) for c in clients for m, k in c.store.log
             if (m, k) in (("check", ("q/1.0",)), ("add", (qm.NEWS,)))]
    total = sum(len(c.store.log) for c in clients) - len(looks)
    assert total <= 4 * replicas + 3, total


def test_a_silent_member_is_left_out_and_a_joiner_let_in(server):
    clients = [_client(server, r, 3) for r in range(3)]
    got = _ask_all(clients[:2], 5, 0, {0, 1, 2})
    # replica 2 never arrived nor beat: gone after start_wait_s, the others go on
    assert {q.members for q in got} == {(0, 1)}
    # its next start asks to be let in; the two take it in at their next step, healing
    # from one of them, with no wait for a silence
    joined = []
    joiner = threading.Thread(target=lambda: joined.append(clients[2].join()))
    joiner.start()
    time.sleep(0.3)
    got = _ask_all(clients[:2], 6, 0, {0, 1})
    joiner.join(timeout=30)
    assert {q.members for q in got} == {(0, 1, 2)} and got[0].healing == (2,)
    assert joined and joined[0] == got[0]


def test_a_retry_goes_on_without_the_member_that_broke_the_step(server):
    clients = [_client(server, r, 3, wait_s=30.0) for r in range(3)]
    for r in range(3):  # all beating: only the retry's grace can leave one out
        clients[r].store.add(f"hb/{r}", 1)
    # (a silence would take 30 s, a timeout raises: the grace alone decides)
    got = _ask_all(clients[:2], 7, 1, {0, 1, 2})
    assert {q.members for q in got} == {(0, 1)}


def test_a_member_marked_left_is_left_out_on_the_news_not_after_a_look(server, monkeypatch):
    # neither the watcher's look nor a silence could decide within the test: only the news
    monkeypatch.setattr(qm, "LOOK_S", 600.0)
    clients = [_client(server, r, 3, wait_s=600.0, start_wait_s=600.0) for r in range(3)]
    for r in range(3):  # each one's first start, beating (as ReplicaGroup makes them)
        clients[r].store.add(f"incarnation/{r}", 1)
        clients[r].store.add(f"hb/{r}", 1)
    _ask_all(clients, 0, 0, {0, 1, 2})
    with ThreadPoolExecutor(1) as pool:
        # replica 0 waits first (the watcher); replica 2's supervisor marks it left; replica
        # 1 arrives later still: the askers and the one gone make the quorum
        first = pool.submit(clients[0].ask, 1, 0, {0, 1, 2})
        time.sleep(0.2)
        mark_left(clients[2].store, 2, 1)
        time.sleep(0.2)
        second = clients[1].ask(1, 0, {0, 1, 2})
        assert first.result(timeout=60).members == second.members == (0, 1)


def test_a_steps_keys_are_let_go_and_a_leader_left_behind_is_told(server, monkeypatch):
    monkeypatch.setattr(qm, "LOOK_S", 60.0)
    clients = [_client(server, r, 3) for r in range(3)]
    everyone = {0, 1, 2}
    held = []
    for step in range(12):
        _ask_all(clients, step, 0, everyone)
        held.append(server.num_keys())
    # the store holds the last steps' keys only, not every step's (R + 3 more a step)
    assert held[-1] == held[-4], held
    prefix = dist.PrefixStore("q/", server)
    assert not prefix.check(["q/3.0"]) and not prefix.check(["in/3.0/0"])
    assert prefix.check(["q/11.0"]) and prefix.check(["in/11.0/2"])
    # a leader that comes back to a step the others decided and let go is not answered with
    # a quorum of its own: it must heal
    late = _client(server, 1, 3)
    monkeypatch.setattr(qm, "LOOK_S", 0.1)  # the others are silent: it decides alone
    with pytest.raises(qm.LeftOut, match="let go"):
        late.ask(4, 0, everyone)
