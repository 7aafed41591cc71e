"""The replica port against someone who holds a captured transfer, or the key itself
(docs/security.md, "Tier-0 snapshots"): a sealed put seen on the wire is taken once, by the
node it was sent to, and never by another; a put of another job neither pushes out nor
overwrites the copies of the job a node runs."""

from __future__ import annotations

import socket

import pytest

from lazarus.agent import replica
from lazarus.agent.tier0 import Tier0Store
from lazarus.agent.tier0_agent import Tier0, Tier0Options
from lazarus.core import snapshotfile
from lazarus.core.records import RoundRecord

KEY = b"k" * 32


def shard(job: str = "j", step: int = 5, rank: int = 1, size: int = 700) -> bytes:
    return snapshotfile.pack({"job": job, "round": 2, "rank": rank, "world_size": 2,
                              "step": step}, b"t" * size, min_saving=2.0)  # stored as it is


class _Tap:
    """A socket that keeps what the client sends (`sent`) and, given `got`, what it receives:
    what anyone on the path sees; `alter(bytes sent so far, chunk) -> chunk` changes what it
    sends on the way."""

    def __init__(self, sock: socket.socket, sent: list[bytes], got: list[bytes] | None = None,
                 alter=None):
        self._sock, self._sent, self._got, self._alter = sock, sent, got, alter

    def sendall(self, data) -> None:
        data = bytes(data)
        if self._alter is not None:
            data = self._alter(b"".join(self._sent), data)
        self._sent.append(data)
        self._sock.sendall(data)

    def recv_into(self, view, n=0):
        k = self._sock.recv_into(view, n)
        if self._got is not None:
            self._got.append(bytes(view[:k]))
        return k

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._sock.close()


def captured(monkeypatch, send) -> bytes:
    """The bytes of one request `send()` makes, as they crossed the network."""
    sent: list[bytes] = []
    real = socket.create_connection
    monkeypatch.setattr(replica.socket, "create_connection",
                        lambda *a, **kw: _Tap(real(*a, **kw), sent))
    send()
    monkeypatch.setattr(replica.socket, "create_connection", real)
    return b"".join(sent)


def replay(port: int, raw: bytes) -> bytes:
    """Send `raw` as it was; what the server answers (b"": it hung up without a word)."""
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(1 << 16):
                answer += chunk
        except OSError:
            pass  # hung up on before the payload was read: refused
    return answer


@pytest.fixture
def nodes(tmp_path):
    """Two agents' replica servers sharing the key: n1 and n2."""
    out = {}
    for node in ("n1", "n2"):
        store = Tier0Store(tmp_path / node, limit_bytes=1 << 20)
        taken: list = []

        def accept(job, rank, step, data, round_, store=store, taken=taken):
            taken.append((job, rank, step))
            store.add_replica(job, rank, step, data)

        out[node] = (replica.ReplicaServer("127.0.0.1", key=KEY, accept=accept,
                                           find=store.path, max_bytes=1 << 20, node=node),
                     store, taken)
    yield out
    for server, store, _ in out.values():
        server.close()


def push(server, **kw) -> None:
    args = {"node": "n0", "to": server.node, "job": "j", "rank": 1, "step": 5, "round_": 2,
            "data": shard()}
    replica.push("127.0.0.1", server.port, KEY, **{**args, **kw})


def test_a_captured_put_replayed_to_its_node_is_refused(nodes, monkeypatch):
    server, store, taken = nodes["n1"]
    raw = captured(monkeypatch, lambda: push(server))
    assert taken == [("j", 1, 5)]
    store.forget(job="gone")  # the copy went (a new round): a replay would bring it back
    assert replay(server.port, raw) == b""
    assert taken == [("j", 1, 5)] and store.path("j", 1, 5) is None
    push(server)  # the sender itself, with a fresh request, is served
    assert taken == [("j", 1, 5)] * 2


def test_a_put_captured_on_its_way_to_one_node_is_refused_by_another(nodes, monkeypatch,
                                                                      tmp_path):
    n1, _, taken1 = nodes["n1"]
    n2, store2, taken2 = nodes["n2"]
    raw = captured(monkeypatch, lambda: push(n1))
    assert taken1 == [("j", 1, 5)]
    assert replay(n2.port, raw) == b""
    assert taken2 == [] and store2.used_bytes() == 0
    # Addressed by port too: the node's next agent (restarted, its nonces forgotten) refuses
    # what was sent to the one before.
    store = Tier0Store(tmp_path / "n1-next", limit_bytes=1 << 20)
    again: list = []
    n1_next = replica.ReplicaServer(
        "127.0.0.1", key=KEY, node="n1", find=store.path, max_bytes=1 << 20,
        accept=lambda job, rank, step, data, round_: again.append((job, rank, step)))
    try:
        assert replay(n1_next.port, raw) == b""
        assert again == []
    finally:
        n1_next.close()


def test_an_answer_played_back_to_another_request_is_refused(nodes, monkeypatch):
    """The sender takes an answer only to its own request: an "ok" captured earlier and
    played back by whoever sits on the path does not say a new copy arrived."""
    server, _, _ = nodes["n1"]
    answers: list = []
    real_recv = replica._recv

    def client_side(sock, key, **kw):  # the server's own reads go through `admit`
        if "admit" in kw:
            return real_recv(sock, key, **kw)
        if not answers:
            answers.append(real_recv(sock, key, **kw))
        else:
            real_recv(sock, key, **kw)  # the true answer, swapped on the way for the old one
        return answers[0]

    monkeypatch.setattr(replica, "_recv", client_side)
    push(server)
    with pytest.raises(replica.ReplicaError, match="answered another request"):
        push(server, step=6, data=shard(step=6))


def test_the_nonces_a_node_remembers_are_bounded_and_expire(monkeypatch):
    monkeypatch.setattr(replica, "MAX_NONCES", 3)
    clock = [1000.0]
    monkeypatch.setattr(replica.time, "time", lambda: clock[0])
    nonces = replica._Nonces()
    for i in range(3):
        nonces.take(f"{i:016d}", clock[0])
    with pytest.raises(replica.ReplicaError, match="replayed"):
        nonces.take(f"{0:016d}", clock[0])
    with pytest.raises(replica.ReplicaError, match="3 requests"):
        nonces.take("3" * 16, clock[0])
    with pytest.raises(replica.ReplicaError, match="without a nonce"):
        nonces.take(None, clock[0])
    # Once their requests are stale (the clock check refuses them), their room is free.
    clock[0] += replica.MAX_SKEW_S + 1
    nonces.take("3" * 16, clock[0])
    assert len(nonces._seen) == 1


def round_of(job: str) -> RoundRecord:
    return RoundRecord(round=2, job_id=job, members=["n0", "n1"], nproc_per_node=1,
                       world_size=2, dp=2, tp=1, store_host="127.0.0.1", store_port=1)


def test_a_put_of_another_job_leaves_the_running_jobs_copies_alone(tmp_path):
    size = len(shard())
    agent = Tier0(node="n1", host="127.0.0.1", lookup=lambda node: None,
                  options=Tier0Options(tmp_path / "n1", 3 * size, KEY))
    try:
        agent.round_seen(round_of("a"))
        for step in (5, 6):
            replica.push("127.0.0.1", agent.port, KEY, node="n0", to="n1", job="a", rank=0,
                         step=step, data=shard("a", step, rank=0), round_=2)
        # A holder of the key (shared by another job's agents too) sends newer copies of its
        # job, enough to fill the node's memory many times over.
        for step in range(100, 104):
            with pytest.raises(replica.ReplicaError, match="job 'b'"):
                replica.push("127.0.0.1", agent.port, KEY, node="x", to="n1", job="b",
                             rank=0, step=step, data=shard("b", step, rank=0), round_=3)
        assert [agent.store.path("a", 0, s) is not None for s in (5, 6)] == [True, True]
    finally:
        agent.close()


def test_the_store_makes_room_for_a_copy_out_of_its_own_jobs_copies_only(tmp_path):
    size = len(shard())
    store = Tier0Store(tmp_path / "t0", limit_bytes=3 * size)
    store.add_replica("a", 0, 5, shard("a", 5, rank=0))
    store.add_replica("a", 0, 6, shard("a", 6, rank=0))
    for step in range(100, 104):  # newer, and over the limit
        store.add_replica("b", 0, step, shard("b", step, rank=0))
    assert store.path("a", 0, 5) is not None and store.path("a", 0, 6) is not None
    assert store.used_bytes() <= 3 * size


def test_jobs_whose_names_read_alike_keep_files_of_their_own(tmp_path):
    store = Tier0Store(tmp_path / "t0", limit_bytes=1 << 20)
    long = "x" * 70
    for job, twin in (("a/b", "a_b"), (long + "1", long + "2")):
        store.add_replica(job, 0, 5, shard(job, rank=0))
        store.add_replica(twin, 0, 5, shard(twin, rank=0))
        assert snapshotfile.read_header(store.path(job, 0, 5).read_bytes())["job"] == job
        store.forget(job=job)  # drops the twin's copy: the job's own stays
        assert store.path(job, 0, 5) is not None
