"""Tier-0 copies encrypted on the wire when the operator asks (`--replica-encrypt`;
agent/replica.py), tried as someone on the network path would: read what crosses it, flip a
byte of it, move its chunks about, or send a copy in the clear to a node that wants none."""

from __future__ import annotations

import argparse
import logging
import socket
import time
from pathlib import Path

import pytest

from lazarus.agent import replica
from lazarus.agent.tier0 import Tier0Store
from lazarus.agent.tier0_agent import add_tier0_args, tier0_options
from lazarus.core import snapshotfile
from lazarus.core.errors import UserError
from tests.integration.test_replica_replay import _Tap

KEY = b"k" * 32
SECRET = b"model-weights-nobody-else-may-read:"


def shard(step: int = 5, size: int = 5000) -> bytes:
    body = (SECRET * (size // len(SECRET) + 1))[:size]
    return snapshotfile.pack({"job": "j", "round": 2, "rank": 1, "world_size": 2,
                              "step": step}, body, min_saving=2.0)  # stored as it is


@pytest.fixture
def wire(monkeypatch):
    log: dict = {"sent": [], "got": [], "alter": None}
    real = socket.create_connection
    monkeypatch.setattr(replica.socket, "create_connection",
                        lambda *a, **kw: _Tap(real(*a, **kw), log["sent"], log["got"],
                                              log["alter"]))
    return log


@pytest.fixture
def node(tmp_path, request):
    """A replica server (n1); `encrypt` from the test's parameter, else off."""
    encrypt = getattr(request, "param", False)
    store = Tier0Store(tmp_path / "n1", limit_bytes=1 << 22)
    taken: list = []

    def accept(job, rank, step, data, round_):
        taken.append((job, rank, step))
        store.add_replica(job, rank, step, data)

    server = replica.ReplicaServer("127.0.0.1", key=KEY, accept=accept, find=store.path,
                                   max_bytes=1 << 22, node="n1", encrypt=encrypt)
    server.taken = taken
    yield server
    server.close()


def logged(caplog, text: str) -> bool:
    """Whether the receiving agent logged `text`: its handler thread logs the refusal after
    hanging up, so the sender may see the end first (a hang guard, not a timing)."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if text in caplog.text:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(autouse=True)
def _refusals_logged(caplog):
    # The agent's logger at WARNING whatever a test before this one (a CLI run in this
    # process) set it to.
    caplog.set_level(logging.WARNING, logger="lazarus.agent.replica")


def push(server, data: bytes, *, encrypt: bool) -> None:
    replica.push("127.0.0.1", server.port, KEY, node="n0", to="n1", job="j", rank=1, step=5,
                 data=data, round_=2, encrypt=encrypt)


def fetch(server, *, encrypt: bool) -> bytearray:
    return replica.fetch("127.0.0.1", server.port, KEY, node="n2", to="n1", job="j", rank=1,
                         step=5, max_bytes=1 << 22, encrypt=encrypt)


@pytest.mark.parametrize("node", [True], indirect=True)
def test_an_encrypted_copy_crosses_the_network_unreadable_both_ways(node, wire, monkeypatch):
    monkeypatch.setattr(replica, "ENC_CHUNK", 1024)  # many chunks, cheaply
    data = shard()
    push(node, data, encrypt=True)
    assert node.taken == [("j", 1, 5)]
    got = fetch(node, encrypt=True)
    assert bytes(got) == data
    sent, received = b"".join(wire["sent"]), b"".join(wire["got"])
    assert len(sent) > len(data) and len(received) > len(data)  # the copy did cross, twice
    for seen in (sent, received):
        assert SECRET[:16] not in seen and data[-32:] not in seen  # nor its sha256
    # ... while in the clear (the default) anyone on the path reads it
    wire["sent"].clear()
    plain = replica.ReplicaServer("127.0.0.1", key=KEY, accept=lambda *a: None,
                                  find=lambda *a: None, max_bytes=1 << 22, node="n1")
    try:
        push(plain, data, encrypt=False)
    finally:
        plain.close()
    assert SECRET in b"".join(wire["sent"])


@pytest.mark.parametrize("node", [True], indirect=True)
def test_a_copy_in_the_clear_to_a_node_that_encrypts_is_refused_unread(node, caplog):
    # The refusal comes before the payload is read, so the sender sees its connection end;
    # the receiving agent's log says why.
    with pytest.raises(replica.ReplicaError):
        push(node, shard(), encrypt=False)
    assert node.taken == []
    assert logged(caplog, "a payload in the clear: this agent takes encrypted copies only")


def _flip(at: int):
    def alter(before: bytes, chunk: bytes) -> bytes:
        i = at - len(before)
        if 0 <= i < len(chunk):
            chunk = chunk[:i] + bytes([chunk[i] ^ 1]) + chunk[i + 1:]
        return chunk
    return alter


@pytest.mark.parametrize("node", [True], indirect=True)
def test_a_byte_flipped_or_chunks_swapped_on_the_way_is_refused(node, wire, monkeypatch,
                                                                caplog):
    monkeypatch.setattr(replica, "ENC_CHUNK", 1024)
    data = shard()
    push(node, data, encrypt=True)  # how long the sealed part is: what precedes the payload
    sealed_part = len(wire["sent"][0])
    wire["sent"].clear()
    wire["alter"] = _flip(sealed_part + 1500)  # in the second chunk's ciphertext
    with pytest.raises(replica.ReplicaError):  # the receiver hangs up on it, saying why:
        push(node, shard(step=6), encrypt=True)
    assert logged(caplog, "chunk 1 of the encrypted snapshot fails its tag")
    caplog.clear()

    chunk = 1024 + 16
    wire["sent"].clear()
    wire["alter"] = _swap_first_two(chunk)
    with pytest.raises(replica.ReplicaError):
        push(node, shard(step=7), encrypt=True)
    assert logged(caplog, "chunk 0 of the encrypted snapshot fails its tag")
    assert node.taken == [("j", 1, 5)]  # only the copy that crossed untouched


def _swap_first_two(chunk: int):
    """Send the payload's second chunk first and its first second (each chunk is one send)."""
    held: list[bytes] = []

    def alter(before: bytes, part: bytes) -> bytes:
        if len(part) != chunk or len(held) >= 2:
            return part
        held.append(part)
        if len(held) == 1:
            return b""  # hold the first back ...
        return held[1] + held[0]  # ... and send it after the second
    return alter


def test_a_node_that_does_not_encrypt_takes_and_answers_one_that_does(node, wire):
    data = shard()
    push(node, data, encrypt=True)
    assert node.taken == [("j", 1, 5)]
    assert bytes(fetch(node, encrypt=True)) == data
    assert SECRET[:16] not in b"".join(wire["got"])  # asked for encrypted, answered so
    assert bytes(fetch(node, encrypt=False)) == data


def test_encrypting_without_a_replica_key_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("LAZARUS_REPLICA_KEY", raising=False)
    p = argparse.ArgumentParser()
    p.add_argument("--node", default="n0")
    add_tier0_args(p)
    args = p.parse_args(["--replica-encrypt", "--tier0-dir", str(tmp_path / "t0")])
    with pytest.raises(UserError, match="--replica-encrypt needs a replica key"):
        tier0_options(args, Path(tmp_path))
    key = tmp_path / "key"
    key.write_text("0123456789abcdef" * 4 + "\n")
    key.chmod(0o600)
    args = p.parse_args(["--replica-encrypt", "--replica-key-file", str(key),
                         "--tier0-dir", str(tmp_path / "t0")])
    assert tier0_options(args, Path(tmp_path)).encrypt is True
