"""The agent's end of the worker channel: a unix socket, one JSON object per line.

Workers send `hello` on each connection, `step` and `progress` reports (fire and forget),
`may_commit` (answered: is your round still current?), `committed` and `checkpoint_failed`.
The agent can push `checkpoint_requested` to every connected rank. When the agent goes away,
its workers reconnect to the same path, where the next agent of the node listens (lazarus.
agent.adopt). See lazarus.trainer.session for the worker's side.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Channel:
    def __init__(self, path: str, *, on_message: Callable[[dict], dict | None]):
        """`on_message` gets each message; a dict it returns is sent back as the reply."""
        self.path = path
        self._on_message = on_message
        if os.path.exists(path):
            os.unlink(path)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(64)
        self._conns: dict[socket.socket, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True, name="channel-accept").start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns[conn] = threading.Lock()
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="channel-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = self._conns[conn]
        try:
            with conn.makefile("r", encoding="utf-8") as rfile:
                for line in rfile:
                    try:
                        msg = json.loads(line)
                        if not isinstance(msg, dict):
                            raise ValueError("not an object")
                    except ValueError:
                        log.warning("dropping malformed worker message %r", line[:120])
                        continue
                    reply = self._on_message(msg)
                    if reply is not None:
                        with send_lock:
                            conn.sendall((json.dumps(reply) + "\n").encode())
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def broadcast(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            conns = list(self._conns.items())
        for conn, send_lock in conns:
            try:
                with send_lock:
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening and hang up on every worker: they then wait for the next agent on
        the same path (lazarus.trainer.session)."""
        self._closed = True
        # Unlinked and shut down first: a worker that reconnects at once must not reach this
        # agent again (a blocked accept() keeps a closed listening socket alive).
        if os.path.exists(self.path):
            os.unlink(self.path)
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        with self._lock:
            for conn in self._conns:
                try:
                    # close() alone leaves the socket open while a reader thread holds it
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
