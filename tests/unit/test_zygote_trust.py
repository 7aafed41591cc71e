"""The zygote runs as the ranks' user (--run-as), whose code may have been tampered with: the
agent takes a pid it reports only when that process is its child, of its user -- it would
later SIGKILL whatever it took -- and a message it cannot parse ends the zygote, not the
agent (lazarus.agent.zygote)."""

from __future__ import annotations

import io
import os
import subprocess
import threading
from types import SimpleNamespace

import pytest

from lazarus.agent.zygote import Zygote


def _listening_as(pid: int) -> Zygote:
    """A Zygote whose process is `pid`, waiting for one parked worker's pid."""
    z = Zygote.__new__(Zygote)
    z.proc = SimpleNamespace(pid=pid)
    z.notes_dir = None
    z._lock = threading.RLock()
    z._waiting = [[0.0, io.BytesIO(), None, True, 0]]
    z._forked, z._codes, z.ready = [], {}, False
    return z


def test_a_pid_not_forked_by_the_zygote_is_not_taken():
    z = _listening_as(os.getpid())
    stdin = z._waiting[0][1]
    z._heard("pid", "1")  # init: on the node, not its child
    assert z._forked == [] and stdin.closed


def test_a_child_of_the_zygote_is_taken():
    child = subprocess.Popen(["sleep", "30"])
    try:
        z = _listening_as(os.getpid())  # this process stands for the zygote: its child
        z._heard("pid", str(child.pid))
        assert [w.pid for w in z._forked] == [child.pid]
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("word,rest", [("pid", "12x"), ("exit", "7 nine"), ("exit", "")])
def test_a_malformed_message_is_a_value_error_the_pump_ends_the_zygote_on(word, rest):
    with pytest.raises(ValueError):
        _listening_as(os.getpid())._heard(word, rest)


def test_the_agent_lets_a_zygote_that_talks_nonsense_go():
    import socket

    z = _listening_as(os.getpid())
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    z.sock, z.dead = ours, False
    try:
        theirs.send(b"pid 12x")
        z.pump()  # no exception reaches the agent's loop
        assert z.dead
    finally:
        ours.close()
        theirs.close()
