"""The trainer's side of the worker <-> agent channel.

Workers never write to etcd (N nodes x 8 ranks must not become N x 8 etcd writers): each rank
talks to its local agent over a unix socket with one JSON object per line. A user's own FSDP
script adopts Lazarus with a few lines:

    session = lazarus.trainer.connect()
    for step in ...:
        ...
        session.report(step=step, loss=loss, grad_norm=gn, tokens=n, step_time_s=dt)
        if session.should_checkpoint(step, every=100):
            save(...) if session.may_commit(step) else skip

Without an agent (env LAZARUS_AGENT_SOCKET unset) the session is local: reports go nowhere,
every commit is allowed, and checkpoints follow the fixed period.
"""

from __future__ import annotations

import json
import math
import os
import queue
import socket
import threading
import time

from lazarus.core.contract import PROGRESS_ENV, RANK_ENV, ROUND_ENV, SOCKET_ENV


# Requests that wait for the agent's answer. The agent answers from etcd state it already
# watches, so this is a local round trip; the bound only matters if the agent is wedged.
_REPLY_TIMEOUT_S = 10.0


class Session:
    """One rank's connection to its node agent.

    `round` is the rendezvous round this worker belongs to: the fencing token the agent checks
    before it lets this rank commit a checkpoint. A worker of an old round is refused.
    """

    def __init__(self, *, socket_path: str | None, rank: int, round: int,
                 publish_progress: bool = True):
        self.rank = rank
        self.round = round
        self.publish_progress = publish_progress
        self._lock = threading.Lock()
        self._request_lock = threading.Lock()  # one request in flight: replies come in order
        self._checkpoint_requested = threading.Event()
        self._replies: queue.Queue[dict] = queue.Queue()
        self._sock: socket.socket | None = None
        if socket_path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(socket_path)
            self._sock = sock
            threading.Thread(target=self._read_loop, args=(sock,), daemon=True,
                             name="lazarus-session").start()
            self._send({"type": "hello", "pid": os.getpid()})

    def _read_loop(self, sock: socket.socket) -> None:
        # The agent pushes requests (a checkpoint now) besides answering ours; one reader
        # thread sorts them so neither the training loop nor a reply ever waits on the other.
        with sock.makefile("r", encoding="utf-8") as rfile:
            for line in rfile:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg.get("type") == "checkpoint_requested":
                    self._checkpoint_requested.set()
                else:
                    self._replies.put(msg)
        self._replies.put({"type": "closed"})

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _send(self, msg: dict) -> None:
        if self._sock is None:
            return
        msg = {"rank": self.rank, "round": self.round, **msg}
        data = (json.dumps(msg, allow_nan=True) + "\n").encode()
        try:
            with self._lock:
                self._sock.sendall(data)
        except OSError:
            # The agent is gone: the node is being torn down and this process with it (its
            # parent death signal). Training must not die on a report it could not send.
            self._sock = None

    def _request(self, msg: dict) -> dict:
        assert self._sock is not None
        with self._request_lock:
            self._send(msg)
            reply = self._replies.get(timeout=_REPLY_TIMEOUT_S)
        if reply.get("type") == "closed":
            raise ConnectionError("agent closed the session")
        return reply

    def report(self, *, step: int, loss: float, grad_norm: float = float("nan"),
               lr: float = 0.0, tokens: int = 0, step_time_s: float = 0.0, **extra) -> None:
        """Tell the agent a step finished. Cheap: one small write on a local socket.

        The trainer adds `skipped` (bool) and, on a step whose batch its guard rejected,
        `spike`: {"reason", "loss", "grad_norm", "window": [first, last]}, the data cursors of
        that batch (lazarus.trainer.train describes it; the agent passes it to the daemon),
        and `compute_s`, the rank's own work in the step (lazarus.trainer.steptime), which
        the straggler test compares across ranks.
        """
        self._send({"type": "step", "step": int(step), "loss": float(loss),
                    "grad_norm": float(grad_norm), "lr": float(lr), "tokens": int(tokens),
                    "step_time_s": float(step_time_s), **extra})

    def progress(self, step: int, phase: str, seq: int, op: str = "") -> None:
        """Where this rank is now (lazarus.agent.hang): the agent notices a rank that stops
        moving, and which rank the others wait for. One small write per phase change."""
        if self._sock is not None and self.publish_progress:
            self._send({"type": "progress", "step": int(step), "phase": phase, "seq": int(seq),
                        "since": time.monotonic(), "op": op})

    def should_checkpoint(self, step: int, every: int) -> bool:
        """True every `every` steps, or when the daemon asked for one since the last call.

        Every rank must call this at the same step so that all ranks agree (a save is
        collective); the daemon's request reaches all agents, and rank 0's answer is the one
        the trainer broadcasts.
        """
        periodic = every > 0 and step % every == 0
        requested = self._checkpoint_requested.is_set()
        self._checkpoint_requested.clear()
        return periodic or requested

    def may_commit(self, step: int) -> bool:
        """Ask whether this rank's round is still the current one (the fencing check)."""
        if self._sock is None:
            return True
        try:
            return bool(self._request({"type": "may_commit", "step": int(step)}).get("ok"))
        except (OSError, ConnectionError, queue.Empty):
            # Unable to confirm the round is current: committing could let a stale worker
            # publish a checkpoint, so refuse.
            return False

    def checkpoint_committed(self, step: int, path: str) -> None:
        self._send({"type": "committed", "step": int(step), "path": str(path)})

    def checkpoint_failed(self, step: int, error: str) -> None:
        """The storage refused the checkpoint of `step` (disk full, read-only, ...): nothing
        was committed and training goes on; the agent publishes it as an event."""
        self._send({"type": "checkpoint_failed", "step": int(step), "error": str(error)[:500]})

    def guard(self, loss: float) -> bool:
        """False when the loss is not finite: the caller skips this optimizer step."""
        return math.isfinite(loss)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._send({"type": "bye"})
                self._sock.close()
            finally:
                self._sock = None


def connect(*, rank: int | None = None, round: int | None = None,
            socket_path: str | None = None) -> Session:
    """A session for this process, from arguments or the environment the agent sets."""
    env = os.environ
    return Session(
        socket_path=socket_path if socket_path is not None else env.get(SOCKET_ENV),
        rank=int(env.get(RANK_ENV, env.get("RANK", "0"))) if rank is None else rank,
        round=int(env.get(ROUND_ENV, "0")) if round is None else round,
        publish_progress=env.get(PROGRESS_ENV, "on") != "off",
    )
