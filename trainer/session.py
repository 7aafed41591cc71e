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

import functools
import json
import math
import os
import queue
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import NoReturn

from lazarus.core import exitcodes
from lazarus.core.contract import (AGENT_GRACE_ENV, ASSIGNMENT_ENV, METRICS_ENV, PROGRESS_ENV,
                                   RANK_ENV, ROUND_ENV, SOCKET_ENV, WorkerAssignment)
from lazarus.trainer import exitnote


# Requests that wait for the agent's answer. The agent answers from etcd state it already
# watches, so this is a local round trip; the bound only matters if the agent is wedged.
_REPLY_TIMEOUT_S = 10.0
# How often a rank whose agent went away looks for the next one on the same socket path.
_RECONNECT_EVERY_S = 0.2
# Reports that must reach an agent, even one that restarts: held while none is there and sent
# to the next one. Step and progress reports are dropped instead: the next one supersedes them.
_KEEP = ("committed", "checkpoint_failed", "refused", "restore_failed")
# The connected sessions of this process: lazarus.trainer.run closes those a failed round's
# `main` left open, or each round would leave its connection and threads in the process.
_open: "weakref.WeakSet[Session]" = weakref.WeakSet()


class Session:
    """One rank's connection to its node agent.

    `round` is the rendezvous round this worker belongs to: the fencing token the agent checks
    before it lets this rank commit a checkpoint. A worker of an old round is refused.

    `agent_grace_s`: how long the rank waits for an agent once the channel closed. An agent
    that restarts (an upgrade, a crash of the agent alone) binds the same socket path again
    and the rank reconnects; meanwhile it trains on, but starts no checkpoint (nobody could
    say whether its round is still current). Past the grace the process exits with
    exitcodes.ORPHANED: its agent is gone for good and the run has gone on without this node.
    None: no reconnecting (the rank trains on alone; a script of the user's own without one).
    """

    def __init__(self, *, socket_path: str | None, rank: int, round: int,
                 publish_progress: bool = True, agent_grace_s: float | None = None,
                 level: int = 1):
        self._level = level
        self._snapshots = None                 # lazarus.trainer.statesnap, on first use
        self._metrics = None                   # $LAZARUS_METRICS, open; False: unwritable
        self.rank = rank
        self.round = round
        self.last_step = 0                     # of the last report()
        self.publish_progress = publish_progress
        self._path = socket_path
        self._grace_s = agent_grace_s
        self._lock = threading.Lock()          # guards _sock and _held
        self._request_lock = threading.Lock()  # one request in flight: replies come in order
        self._checkpoint_requested = threading.Event()
        self._replies: queue.Queue[dict] = queue.Queue()
        self._kept: queue.Queue[tuple[int, bool, float]] = queue.Queue()
        self._resume: queue.Queue[dict] = queue.Queue()
        self._sock: socket.socket | None = None
        self._up = threading.Event()           # an agent is connected now
        self._held: list[dict] = []
        self._closed = False
        if socket_path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(socket_path)
            self._attach(sock)
            threading.Thread(target=self._read_loop, args=(sock,), daemon=True,
                             name="lazarus-session").start()
            _open.add(self)

    def _attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            held, self._held = self._held, []
        self._send({"type": "hello", "pid": os.getpid()})
        for msg in held:
            self._send(msg)
        self._up.set()

    def _read_loop(self, sock: socket.socket) -> None:
        # The agent pushes requests (a checkpoint now) besides answering ours; one reader
        # thread sorts them so neither the training loop nor a reply ever waits on the other.
        while True:
            try:
                with sock.makefile("r", encoding="utf-8") as rfile:
                    for line in rfile:
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            continue
                        if msg.get("type") == "checkpoint_requested":
                            self._checkpoint_requested.set()
                        elif msg.get("type") == "resume":
                            self._resume.put(msg)
                        elif msg.get("type") == "abort_groups":
                            if msg.get("round") == self.round and not self._closed:
                                # here: inplace imports this module
                                from lazarus.trainer import inplace
                                inplace.told_by_agent(self.round)
                        elif msg.get("type") == "snapshot_kept":
                            if msg.get("rank") == self.rank:
                                self._kept.put((msg.get("step"), msg.get("durable") is True,
                                                time.perf_counter()))
                        else:
                            self._replies.put(msg)
            except OSError:
                pass
            self._detach(sock)
            self._replies.put({"type": "closed"})  # a request waiting for a reply gives up
            # A survivor waiting for its next round gives up too: the agent that kept it is
            # gone, and the next one does not know it (its kept survivors live in memory).
            self._resume.put({"type": "agent_gone"})
            if self._closed or self._grace_s is None:
                return
            sock = self._await_agent()
            if sock is None:
                return

    def _detach(self, sock: socket.socket) -> None:
        self._up.clear()
        with self._lock:
            if self._sock is sock:
                self._sock = None
        sock.close()

    def _await_agent(self) -> socket.socket | None:
        """The next agent's connection (None: this session was closed meanwhile), or the end
        of this process once the grace is over."""
        assert self._path is not None and self._grace_s is not None
        print(f"rank {self.rank} round {self.round}: the agent is gone; waiting up to "
              f"{self._grace_s:.0f} s for it to come back", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self._grace_s
        while time.monotonic() < deadline:
            if self._closed:
                return None
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._path)
            except OSError:  # no socket yet, or the dead agent's file: nobody listens
                sock.close()
                time.sleep(_RECONNECT_EVERY_S)
                continue
            self._attach(sock)
            print(f"rank {self.rank} round {self.round}: reconnected to the agent",
                  file=sys.stderr, flush=True)
            return sock
        self._give_up()

    def _give_up(self) -> NoReturn:
        print(f"rank {self.rank} round {self.round}: no agent came back within "
              f"{self._grace_s:.0f} s; stopping (the run goes on without this node)",
              file=sys.stderr, flush=True)
        exitnote.exit_now(exitcodes.ORPHANED)

    @property
    def connected(self) -> bool:
        """Whether this rank runs under an agent (for the life of the session, whether or not
        the agent is reachable this moment: every rank must take the same code path)."""
        return self._path is not None and not self._closed

    def _send(self, msg: dict) -> None:
        if self._path is None:
            return
        msg = {"rank": self.rank, "round": self.round, **msg}
        data = (json.dumps(msg, allow_nan=True) + "\n").encode()
        with self._lock:
            sock = self._sock
            if sock is None:
                if msg["type"] in _KEEP:
                    self._held.append(msg)
                return
            try:
                sock.sendall(data)
            except OSError:
                # The agent is gone: training must not die on a report it could not send.
                # The reader sees the socket close and waits for the next agent.
                if msg["type"] in _KEEP:
                    self._held.append(msg)

    def _wait_for_agent(self) -> bool:
        """Block until an agent is connected (True without one: nothing to wait for); False
        if none comes within the grace, or at once when this session does not reconnect."""
        if self._path is None or self._up.is_set():
            return True
        return self._grace_s is not None and self._up.wait(self._grace_s)

    def _request(self, msg: dict) -> dict:
        with self._request_lock:
            if not self._wait_for_agent():
                raise ConnectionError("no agent")
            while not self._replies.empty():  # a "closed" left by an earlier disconnect
                self._replies.get_nowait()
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
        self.last_step = int(step)
        msg = {"type": "step", "step": int(step), "loss": float(loss),
               "grad_norm": float(grad_norm), "lr": float(lr), "tokens": int(tokens),
               "step_time_s": float(step_time_s), **extra}
        self._send(msg)
        if self._level and self.rank == 0 and os.environ.get(METRICS_ENV):
            self._log_step(msg)

    def _log_step(self, msg: dict) -> None:
        """Rank 0 of a script's own (level 1): its step as a line of the run's metrics file
        ($LAZARUS_METRICS), which `lazarus report` draws the run's story from."""
        row = {k: v for k, v in msg.items() if k != "type"}
        try:
            if self._metrics is None:
                self._metrics = open(os.environ[METRICS_ENV], "a", encoding="utf-8")
            self._metrics.write(json.dumps({**row, "round": self.round}) + "\n")
            self._metrics.flush()
        except (OSError, TypeError, ValueError) as e:
            if self._metrics is not False:
                print(f"rank 0: step reports not written to ${METRICS_ENV}: {e}",
                      file=sys.stderr, flush=True)
            self._metrics = False

    def progress(self, step: int, phase: str, seq: int, op: str = "") -> None:
        """Where this rank is now (lazarus.agent.hang): the agent notices a rank that stops
        moving, and which rank the others wait for. One small write per phase change."""
        global _script_progress
        if self._level:
            _script_progress = True
        if self.publish_progress:
            self._send({"type": "progress", "step": int(step), "phase": phase, "seq": int(seq),
                        "since": time.monotonic(), "op": op})

    def joined(self) -> None:
        """This rank made its default process group: the round's rendezvous is done here."""
        self._send({"type": "joined"})

    def should_checkpoint(self, step: int, every: int) -> bool:
        """True every `every` steps, or when the daemon asked for one since the last call.

        Every rank must call this at the same step so that all ranks agree (a save is
        collective); the daemon's request reaches all agents, and rank 0's answer is the one
        the trainer broadcasts.

        While the agent is away (it restarts) a save waits here for the next one: a rank
        whose agent never comes back must not write into the checkpoint dir that the run,
        going on without it, may be writing too.
        """
        periodic = every > 0 and step % every == 0
        requested = self._checkpoint_requested.is_set()
        self._checkpoint_requested.clear()
        if (periodic or requested) and not self._wait_for_agent() and self._grace_s is not None:
            self._give_up()
        return periodic or requested

    def may_commit(self, step: int) -> bool:
        """Ask whether this rank's round is still the current one (the fencing check)."""
        if self._path is None:
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

    def snapshot_written(self, step: int, path: str) -> None:
        """A tier-0 snapshot of this rank at `step` is in `path` (lazarus.trainer.snapshot):
        the agent owns the file from now on and replicates it to its peer node."""
        self._send({"type": "snapshot", "step": int(step), "path": str(path)})

    def restore_failed(self, checkpoint: str, *, kind: str, reason: str) -> None:
        """The checkpoint to restore could not be loaded (exitcodes.BAD_CHECKPOINT follows):
        `kind` is what this rank found wrong from here (lazarus.core.contract: corrupt,
        missing, unreadable; "" when it read its part and another rank did not), `reason`
        its words, or the first problem another rank found."""
        self._send({"type": "restore_failed", "checkpoint": str(checkpoint)[:500],
                    "kind": str(kind), "reason": str(reason)[:500]})

    def snapshots_kept(self) -> list[tuple[int, bool, float]]:
        """(step, durable, when by time.perf_counter) of each of this rank's snapshots the
        agent has settled since the last call: durable when its peer node holds a copy (or
        the agent, without a peer), not when it never will (lazarus.agent.tier0_agent)."""
        out = []
        while True:
            try:
                out.append(self._kept.get_nowait())
            except queue.Empty:
                return out

    def survived(self, step: int, reason: str) -> None:
        """This rank lost a peer but not itself: its process stays, its process groups are
        gone, and it waits for the next round's assignment (`await_resume`) instead of
        exiting (lazarus.trainer.inplace). `step`: the last step it completed."""
        while not self._resume.empty():  # what an agent gone before this round said
            self._resume.get_nowait()
        if self._path is not None and not self._up.is_set():
            self._resume.put({"type": "agent_gone"})  # no agent now to tell: none will keep it
        self._send({"type": "survivor", "pid": os.getpid(), "step": int(step),
                    "reason": str(reason)[:500]})

    def await_resume(self, timeout_s: float) -> dict | None:
        """The assignment the agent hands this survivor for the next round (a WorkerAssignment
        as a dict), or None when none came within `timeout_s`: the round went on without this
        process, which then exits as a lost peer's survivor always did. None at once when
        the agent goes away meanwhile: nothing else would hand this process a round, and it
        must not hold its device for the rest of `timeout_s`."""
        try:
            msg = self._resume.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if msg.get("type") == "agent_gone":
            print(f"rank {self.rank} round {self.round}: the agent that kept this process "
                  f"for the next round is gone", file=sys.stderr, flush=True)
            return None
        a = msg.get("assignment")
        return a if isinstance(a, dict) else None

    def refused(self, reason: str) -> None:
        """This rank will not run the job as configured (lazarus.core.exitcodes.REFUSED):
        the agent publishes why, and the daemon fails the run with it."""
        self._send({"type": "refused", "reason": str(reason)[:500]})

    # -- tier 0 for a script's own state (lazarus.trainer.statesnap) -------------------------
    def snapshot(self, step: int, state) -> float:
        """Keep `state` of `step` in host memory, replicated by the agent to its peer node:
        a later round restores it with `restore()` instead of reading storage. Every rank
        must snapshot at the same steps (a restore needs every rank's copy of one step).

        `state`: dicts, lists and tuples of tensors (a DTensor keeps its local shard) and JSON
        values -- e.g. {"model": ..., "optim": ...} from
        torch.distributed.checkpoint.state_dict.get_state_dict, plus the script's data
        position. Costs a copy of this rank's tensors into host memory (returned: the stall
        in seconds) and blocks only on the previous snapshot's write; nothing without an
        agent that keeps snapshots. ValueError for a state it cannot hold."""
        a = _assignment()
        if self._path is None or a is None or not a.snapshot_dir:
            return 0.0
        if self._snapshots is None:
            import atexit

            # lazily: statesnap loads torch and safetensors, which a session need not
            from lazarus.trainer.statesnap import StateSnapshots
            self._snapshots = StateSnapshots(
                Path(a.snapshot_dir), on_written=self.snapshot_written,
                header={"job": a.job_id, "round": a.round, "rank": a.rank,
                        "world_size": a.world_size})
            atexit.register(self._snapshots.close)  # the last one is written before the exit
        return self._snapshots.take(step, state)

    def restore(self, into=None):
        """(step, state) of this rank's copy in memory when the round restores from memory
        (the daemon chose a step every rank's copy holds, newer than any checkpoint), else
        None: the script then loads its own checkpoint, or starts afresh. Sets torch's RNG as
        it was. `into`: the live state (same structure as snapshotted, e.g. a fresh
        get_state_dict): each saved tensor is copied into the live one in place, so DTensors
        keep their sharding; pass the result to set_state_dict. Raises
        lazarus.core.errors.CheckpointError when the copy cannot be read or does not fit:
        exit then (the daemon restores from storage next)."""
        a = _assignment()
        if a is None or not a.snapshot:
            return None
        # lazily: statesnap loads torch and safetensors, which a session need not
        from lazarus.trainer import statesnap

        step, state = statesnap.read(a.snapshot, rank=a.rank, world_size=a.world_size)
        if into is not None:
            state = statesnap.copy_into(state, into, a.snapshot)
        return step, state

    def restore_point(self) -> tuple[int, str] | None:
        """(step, path) of the committed checkpoint this round restores when it does not
        restore from memory: the newest good one the script reported with
        `checkpoint_committed`, or an earlier one after the daemon rolled the run back past
        repeated loss spikes. None: from scratch (or from memory: see `restore`). A script
        that reports its checkpoints should load this one, not merely its newest."""
        a = _assignment()
        if a is None or not a.restore or a.snapshot:
            return None
        return a.restore_step, a.restore

    def skip_windows(self) -> list[tuple[int, int]]:
        """The data windows [first, last] the daemon ordered skipped after repeated loss
        spikes: the `window`s that step reports' `spike` named (see `report`). The script's
        data loader must not serve them again."""
        a = _assignment()
        windows = (a.train.get("data", {}).get("skip_windows") if a is not None else None) or []
        return [(int(w[0]), int(w[1])) for w in windows]

    def guard(self, loss: float) -> bool:
        """False when the loss is not finite: the caller skips this optimizer step."""
        return math.isfinite(loss)

    def close(self) -> None:
        _open.discard(self)
        if self._snapshots is not None:
            self._snapshots.close()
            # ... and off atexit's list, which would keep its buffers for the process's life
            import atexit
            atexit.unregister(self._snapshots.close)
        if self._metrics:
            self._metrics.close()
            self._metrics = None
        if self._closed:
            return
        self._closed = True  # before the socket closes: the reader must not wait for an agent
        self._send({"type": "bye"})
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader: close() alone would not
            except OSError:
                pass
            sock.close()


def script_sessions() -> set[Session]:
    """The script's connected sessions (level 1; not Lazarus's own watch) not closed yet."""
    return {s for s in list(_open) if s._level >= 1}


_script_progress = False  # the script reports its own progress (level 1)


def progress_by_script() -> bool:
    """Whether the script reports where it is itself (lazarus.trainer.collwatch stops then)."""
    return _script_progress


def connect(*, rank: int | None = None, round: int | None = None,
            socket_path: str | None = None, level: int = 1) -> Session:
    """A session for this process, from arguments or the environment the agent sets.
    `level` 0 is Lazarus's own watch of a script that does not report (collwatch)."""
    env = os.environ
    return Session(
        socket_path=socket_path if socket_path is not None else env.get(SOCKET_ENV),
        rank=int(env.get(RANK_ENV, env.get("RANK", "0"))) if rank is None else rank,
        round=int(env.get(ROUND_ENV, "0")) if round is None else round,
        publish_progress=env.get(PROGRESS_ENV, "on") != "off",
        agent_grace_s=float(env[AGENT_GRACE_ENV]) if env.get(AGENT_GRACE_ENV) else None,
        level=level,
    )


def _assignment():
    """This rank's assignment, as the agent handed it (None outside an agent's round)."""
    return _parsed_assignment(os.environ.get(ASSIGNMENT_ENV) or "")


@functools.lru_cache(maxsize=1)
def _parsed_assignment(text: str):
    # parsed once per process, not at every snapshot (the environment does not change)
    if not text:
        return None
    try:
        return WorkerAssignment.from_json(text)
    except ValueError:
        return None
