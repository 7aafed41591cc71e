"""A process on the worker channel that sends a line without end (100 MB, no newline) is hung
up on once its line passes MAX_LINE_BYTES, with a log line: the agent holds at most about
that much for it, and the other workers' connections, open before or made after, go on."""

from __future__ import annotations

import json
import logging
import socket
import threading
import tracemalloc

from lazarus.agent import channel as ch

ATTACK_BYTES = 100 * 2**20


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)  # a hang guard, not a timing
    s.connect(path)
    return s


def _may_commit(s: socket.socket) -> dict:
    s.sendall(b'{"type": "may_commit", "step": 3}\n')
    reply = b""
    while not reply.endswith(b"\n"):
        reply += s.recv(4096)
    return json.loads(reply)


def test_an_endless_line_is_hung_up_on_and_others_keep_talking(tmp_path, caplog):
    got: list[dict] = []

    def on_message(msg: dict) -> dict | None:
        got.append(msg)
        return {"type": "may_commit", "ok": True} if msg.get("type") == "may_commit" else None

    channel = ch.Channel(str(tmp_path / "agent.sock"), on_message=on_message,
                         admit=lambda pid: True)
    chunk = b"x" * 2**20  # sent 100 times: the attack's bytes are not the test's memory
    try:
        before = _connect(channel.path)
        assert _may_commit(before)["ok"] is True
        caplog.set_level(logging.WARNING, logger=ch.__name__)
        tracemalloc.start()
        try:
            sent, refused = 0, None
            with _connect(channel.path) as attacker:
                attacker.sendall(b'{"type": "step", "step": 1, "pad": "')
                try:
                    while sent < ATTACK_BYTES:
                        attacker.sendall(chunk)
                        sent += len(chunk)
                except OSError as e:  # the agent hung up
                    refused = e
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert refused is not None and sent < ATTACK_BYTES // 10, (sent, refused)
        assert peak < 8 * ch.MAX_LINE_BYTES, peak
        assert any("sent a line of over" in r.getMessage() for r in caplog.records)

        # the connection open before the attack, and one made after it, are served
        assert _may_commit(before)["ok"] is True
        with _connect(channel.path) as after:
            assert _may_commit(after)["ok"] is True
        assert [m["type"] for m in got] == ["may_commit"] * 3
        before.close()
    finally:
        channel.close()


def test_lines_split_across_reads_and_a_last_line_without_newline_arrive_whole(tmp_path):
    got: list[dict] = []
    done = threading.Event()

    def on_message(msg: dict) -> None:
        got.append(msg)
        if msg.get("type") == "bye":
            done.set()

    channel = ch.Channel(str(tmp_path / "agent.sock"), on_message=on_message,
                         admit=lambda pid: True)
    try:
        big = {"type": "step", "step": 2, "note": "y" * (ch.MAX_LINE_BYTES - 100)}
        with _connect(channel.path) as s:
            s.sendall(b'{"type": "st')
            s.sendall(b'ep", "step": 1}\n' + json.dumps(big).encode() + b"\nnot json\n")
            s.sendall(b'{"type": "bye"}')
        assert done.wait(30)
        assert got == [{"type": "step", "step": 1}, big, {"type": "bye"}]
    finally:
        channel.close()


def test_a_process_opening_many_connections_gets_a_few_threads_not_thousands(tmp_path, caplog):
    """Each connection costs the agent a thread: past MAX_CONNS_PER_PID a process's next ones
    are hung up on (said once), and the ones it holds keep working."""
    channel = ch.Channel(str(tmp_path / "agent.sock"),
                         on_message=lambda msg: {"type": "may_commit", "ok": True},
                         admit=lambda pid: True)
    caplog.set_level(logging.WARNING, logger=ch.__name__)
    conns = [_connect(channel.path) for _ in range(3 * ch.MAX_CONNS_PER_PID)]
    try:
        answered = 0
        for s in conns:
            try:
                s.sendall(b'{"type": "may_commit", "step": 3}\n')
                reply = b""
                while not reply.endswith(b"\n") and (chunk := s.recv(4096)):
                    reply += chunk
                answered += reply.endswith(b"\n")
            except OSError:
                pass  # hung up on before the send
        assert answered == ch.MAX_CONNS_PER_PID
        said = [r for r in caplog.records if "connections (at most" in r.getMessage()]
        assert len(said) == 1
    finally:
        for s in conns:
            s.close()
        channel.close()
