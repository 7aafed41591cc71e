"""The agent's end of the worker channel: a unix socket, one JSON object per line.

Workers send `hello` on each connection, `step` and `progress` reports (fire and forget),
`may_commit` (answered: is your round still current?), `committed` and `checkpoint_failed`.
The agent can push `checkpoint_requested` to every connected rank. When the agent goes away,
its workers reconnect to the same path, where the next agent of the node listens (lazarus.
agent.adopt). See lazarus.trainer.session for the worker's side.

Only the agent's own processes may talk on it: a message here can commit a checkpoint for the
round or feed the hang detector. The socket lives in the agent's private workdir (lazarus.
core.privatedir), and each connection's peer, as the kernel names it (SO_PEERCRED), must run
as this user and pass `admit` (the agent admits its workers and what they start); any other
is hung up on before a byte is read, and logged once per process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Collection

import psutil

from lazarus.core.jobuser import JobUser

log = logging.getLogger(__name__)

# Refused processes already logged; forgotten past this many (each one is logged once anyway).
MAX_REFUSED_REMEMBERED = 1024

# The longest line a worker may send. Ranks send a few hundred bytes (a step report with its
# spike window, a path, a reason cut at 500 characters; stacks and flight records go to
# files): 1 MiB leaves room for a script's own report fields, and keeps a process that
# sends without a newline from growing the agent's memory without end.
MAX_LINE_BYTES = 1 << 20
# A rank holds one or two connections (its session, a watcher's); each costs the agent a
# thread. The job's code could open thousands: past these, a connection is hung up on.
MAX_CONNS_PER_PID = 8
MAX_CONNS = 1024
_RECV_BYTES = 1 << 16


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a unix socket, as the kernel saw it
    connect."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def descends_from(pid: int, roots: Collection[int]) -> bool:
    """Whether `pid` is one of `roots` or was started, however deep, by one of them."""
    if pid in roots:
        return True
    try:
        return any(p.pid in roots for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False  # gone already: nothing to talk to


class Channel:
    def __init__(self, path: str, *, on_message: Callable[[dict], dict | None],
                 admit: Callable[[int], bool], job_user: JobUser | None = None):
        """`on_message` gets each message; a dict it returns is sent back as the reply.
        `admit(pid)`: whether the process `pid` (of this user, or of `job_user`: the one
        the ranks run as) may use the channel."""
        self.path = path
        self._on_message = on_message
        self._admit = admit
        self._refused: set[int] = set()
        if os.path.exists(path):
            os.unlink(path)
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._uids = {os.geteuid()}
        if job_user is None:
            os.chmod(path, 0o600)
        else:  # connecting takes write permission on the socket: the ranks' group has it
            self._uids.add(job_user.uid)
            os.chown(path, -1, job_user.gid)
            os.chmod(path, 0o660)
        self._server.listen(64)
        self._conns: dict[socket.socket, threading.Lock] = {}
        self._pids: dict[socket.socket, int] = {}  # who is at the other end, by the kernel
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True, name="channel-accept").start()

    def _admitted(self, conn: socket.socket) -> int | None:
        """The pid of `conn`'s peer when it may use the channel, else None."""
        pid, uid = peer_credentials(conn)
        if uid in self._uids and self._admit(pid):
            return pid
        if pid not in self._refused:
            if len(self._refused) >= MAX_REFUSED_REMEMBERED:
                self._refused.clear()
            self._refused.add(pid)
            log.warning("refused a connection to %s from pid %d (uid %d): %s", self.path, pid,
                        uid, "not one of this agent's workers" if uid in self._uids else
                        f"another user (this agent and its ranks run as uid(s) "
                        f"{', '.join(map(str, sorted(self._uids)))})")
        return None

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            try:
                pid = self._admitted(conn)
            except OSError:
                pid = None
            if pid is None:
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                mine = sum(1 for p in self._pids.values() if p == pid)
                if mine >= MAX_CONNS_PER_PID or len(self._conns) >= MAX_CONNS:
                    conn.close()
                    if pid not in self._refused:
                        self._refused.add(pid)
                        log.warning("hung up on pid %d at %s: it holds %d connections (at most "
                                    "%d a process, %d in all)", pid, self.path, mine,
                                    MAX_CONNS_PER_PID, MAX_CONNS)
                    continue
                self._conns[conn] = threading.Lock()
                self._pids[conn] = pid
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="channel-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        send_lock = self._conns[conn]
        try:
            for line in self._lines(conn):
                try:
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise ValueError("not an object")
                except (ValueError, RecursionError):
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
                self._pids.pop(conn, None)
            conn.close()

    def _lines(self, conn: socket.socket):
        """The lines `conn` sends (without their newline; a last one cut off by the close
        included), until it closes or sends a line longer than MAX_LINE_BYTES, which ends the
        connection: never more than that held for it."""
        pending = b""
        while chunk := conn.recv(_RECV_BYTES):
            *lines, pending = (pending + chunk).split(b"\n")
            yield from lines
            if len(pending) > MAX_LINE_BYTES:
                try:
                    pid = peer_credentials(conn)[0]
                except OSError:
                    pid = 0
                log.warning("hung up on pid %d at %s: it sent a line of over %d bytes (a "
                            "worker's message is a few hundred)", pid, self.path, MAX_LINE_BYTES)
                return
        if pending:
            yield pending

    def broadcast(self, msg: dict) -> None:
        self._send(msg, lambda conn: True)

    def send_to(self, pid: int, msg: dict) -> bool:
        """Send `msg` to the connections of process `pid` only: whether one took it."""
        return self._send(msg, lambda conn: self._pids.get(conn) == pid)

    def _send(self, msg: dict, to: Callable[[socket.socket], bool]) -> bool:
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            conns = [(c, lock) for c, lock in self._conns.items() if to(c)]
        sent = False
        for conn, send_lock in conns:
            try:
                with send_lock:
                    conn.sendall(data)
                sent = True
            except OSError:
                pass
        return sent

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
