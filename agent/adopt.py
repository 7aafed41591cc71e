"""Ranks that outlive their agent, and the agent that takes them over.

An agent restarts (an upgrade, systemd's Restart=always after a crash of the agent alone)
while its ranks train; the ranks are not its children's children to kill: they run in
sessions of their own without a parent-death signal, as containers outlive a containerd
restart under their shims. What the agent launched is written down in its workdir (`Left`,
replaced atomically), and the next agent of the same node reads it at start: it resumes the
node's lease (so the daemon sees no node loss), takes each rank that is still the process it
launched (pid and start time: a reused pid is never taken), and supervises them by polling,
since it cannot wait() for processes it did not start. A rank's exit code comes from the
note it leaves (lazarus.core.contract.exit_note_path); one that vanished without a note was
killed, and counts as a crash.

If no agent comes back within the lease TTL, the daemon recovers without the node as for
any node loss, and the ranks stop themselves once their grace runs out
(lazarus.trainer.session).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from lazarus.core import rankfiles
from lazarus.core.contract import exit_note_path
from lazarus.core.errors import UserError

log = logging.getLogger(__name__)

# The exit code of an adopted rank that vanished without leaving a note: killed (SIGKILL,
# the OOM killer) or gone before it could write one. A crash, as far as recovery goes.
VANISHED = -1


def start_time(pid: int) -> float | None:
    """When `pid` started (psutil's clock, the one the notes use); None if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _same(a: float, b: float) -> bool:
    return abs(a - b) < 0.01  # both come from /proc's start time in clock ticks


@dataclass(kw_only=True, slots=True)
class LeftRank:
    local_rank: int
    rank: int
    pid: int
    started: float  # start time of the process (start_time), 0 if it was already gone


@dataclass(kw_only=True, slots=True)
class Left:
    """What an agent launched, as the next agent of the same node needs it."""
    node: str
    round: int
    job_id: str
    world_size: int
    lease: int                  # the node's etcd lease when this was written
    channel: str                # the unix socket the ranks reconnect to
    checkpoint_dir: str | None
    agent_pid: int
    ranks: list[LeftRank] = field(default_factory=list)
    # the round the ranks were launched in, when a replica round carried them on into
    # `round` (docs/replicas.md); None in a record from before it: the same as `round`
    rank_round: int | None = None

    def __post_init__(self) -> None:
        if self.rank_round is None:
            self.rank_round = self.round

    def save(self, path: Path) -> None:
        """Write and rename: a reader sees the old record or the new one, never half."""
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Left | None:
        """The record at `path`; None when there is none, or it cannot be read (logged: its
        ranks are then left to stop by themselves)."""
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            d["ranks"] = [LeftRank(**r) for r in d["ranks"]]
            return cls(**d)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("ignoring unreadable record of running ranks %s: %s", path, e)
            return None


def record_path(workdir: Path, node: str) -> Path:
    """Where the agent of `node` with this --workdir writes down its running ranks."""
    return workdir / f"{node}.ranks.json"


def left_ranks(workdir: Path, node: str) -> list[AdoptedRank]:
    """The ranks the agent of `node` left written down, as they are now (for tools that stop
    a whole node: its agent first, then these)."""
    left = Left.load(record_path(workdir, node))
    return list(adopt(left, workdir / "stacks" / node).values()) if left is not None else []


def forget(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def read_note(notes_dir: Path, pid: int, started: float) -> int | None:
    """The exit code process (`pid`, `started`) left, if it left one."""
    try:
        # a bounded read of a file of ours: never a symlink's target, a FIFO's wait
        note = json.loads(rankfiles.read(exit_note_path(notes_dir, pid), limit=1 << 16))
        if int(note["pid"]) == pid and _same(float(note["started"]), started):
            return int(note["code"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return None


class AdoptedRank:
    """A rank this agent did not start, behind the part of Popen's interface the agent uses."""

    def __init__(self, pid: int, started: float, notes_dir: Path):
        self.pid, self.started, self.notes_dir = pid, started, notes_dir
        self.returncode: int | None = None

    def _alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            # A zombie has exited; who reaps it (init, a subreaper) is no business of ours.
            return _same(proc.create_time(), self.started) and \
                proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def poll(self) -> int | None:
        if self.returncode is None and not self._alive():
            code = read_note(self.notes_dir, self.pid, self.started)
            self.returncode = VANISHED if code is None else code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that now names another process
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                # A rank of another user (--run-as) and an agent without CAP_KILL: the agent
                # checked its capabilities at start, so this is a pid reused by a stranger.
                log.warning("not allowed to signal pid %d: no longer this agent's rank", self.pid)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode


def adopt(left: Left, notes_dir: Path) -> dict[int, AdoptedRank]:
    """local rank -> the rank as it is now: running, or exited with its code (a rank that
    ended while no agent watched is reported all the same)."""
    return {r.local_rank: AdoptedRank(r.pid, r.started, notes_dir) for r in left.ranks}


class NodeLock:
    """One agent per node and workdir: a second one would take over the first one's socket
    and ranks. An flock, so the kernel releases it however the holder dies."""

    def __init__(self, path: Path, node: str):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self._fd, 64).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise UserError(f"another agent runs node {node} from this workdir (pid {holder}); "
                            "stop it first, or give this one its own --workdir") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
