"""A survivor on gloo shuts its connections of the round it left (lazarus.trainer.inplace
.hang_up_tcp): gloo's abort leaves them open, and a peer blocked in a collective on one waits
until this process exits -- at 8 ranks, 5 of 7 survivors were lost that way (docs/scale.md).
The peer here is this test process; the survivor a child that holds a connection to it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

CHILD = """
import socket, sys
from lazarus.trainer.inplace import hang_up_tcp
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
listening = socket.socket()
listening.bind(("127.0.0.1", 0)); listening.listen()
print(hang_up_tcp(), flush=True)   # the connection, not the listening socket
listening.accept  # still usable: not shut down
sys.stdin.readline()               # alive until told: its exit would close the connection too
"""


def test_the_peer_blocked_on_a_survivors_connection_is_woken_while_it_lives():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(server.getsockname()[1])],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parents[2])
        try:
            conn, _ = server.accept()
            conn.settimeout(30)  # a hang guard: the child is alive all along
            assert child.stdout.readline().strip() == "1"
            assert conn.recv(1) == b""  # the peer's blocked read ends: EOF
            assert child.poll() is None
            conn.close()
        finally:
            child.stdin.close()
            child.wait(timeout=30)
