"""The agent's side of the worker zygote (lazarus.trainer.zygote): start it, ask it for parked
workers without ever waiting on it, and follow the workers it forked.

The agent's loop must not stall on the zygote: a spawn is a message sent, its pid arrives on a
later pass (`pump`). A zygote that dies, or answers nothing in time (stopped, say),
is killed and replaced at most once per ZYGOTE_RETRY_S; meanwhile lazarus.agent.workers starts
cold workers as it always could. The workers it forked are not the agent's children: their
exit codes come from the zygote, which reaps them, and without it from the notes ranks leave
and /proc, as for ranks adopted from a previous agent (lazarus.agent.adopt).
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from lazarus.agent.adopt import VANISHED, AdoptedRank, read_note, start_time
from lazarus.core import rankfiles
from lazarus.core.jobuser import JobUser

log = logging.getLogger(__name__)

ZYGOTE_CMD = [sys.executable, "-m", "lazarus.cli", "worker", "--zygote"]
# How long a started zygote may take to import everything (5 s of CPU here; a loaded node
# stretches that), and to answer a spawn (a fork: milliseconds), before it is taken for stuck.
ZYGOTE_START_S = 120.0
ZYGOTE_ANSWER_S = 30.0
ZYGOTE_RETRY_S = 60.0
# A forked worker seen exited that the zygote has not reported yet: the zygote is slow or
# stopped. After this long its code comes from the rank's note instead -- unless the zygote
# is rehearsing a step (seconds), which it reports after.
REPORT_GRACE_S = 1.0
MAX_CODES = 1024


class ForkedWorker(AdoptedRank):
    """A parked worker the zygote forked, behind the part of Popen's interface the agent
    uses (`stdin`: the pipe its assignment line goes down)."""

    def __init__(self, pid: int, stdin, zygote: Zygote, notes_dir: Path, generation: int = 0):
        super().__init__(pid, start_time(pid) or 0.0, notes_dir)
        self.stdin = stdin
        self.zygote = zygote
        # how many rehearsals the zygote had been asked for before it forked this worker
        self.generation = generation
        self._unreported_since: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        code = self.zygote.exit_code(self.pid)
        if code is not None:
            self.returncode = code
        elif not self._alive():
            # Exited (a zombie the zygote has not reaped, or reaped by init after the zygote
            # went): the zygote's word if it comes soon, else the rank's own note.
            now = time.monotonic()
            if self._unreported_since is None:
                self._unreported_since = now
            if self.zygote.dead or (now - self._unreported_since >= REPORT_GRACE_S
                                    and not self.zygote.rehearsing(now)):
                code = read_note(self.notes_dir, self.pid, self.started)
                self.returncode = VANISHED if code is None else code
        return self.returncode

    def kill(self) -> None:
        super().kill()
        self._close_stdin()

    def wait(self, timeout: float | None = None) -> int:
        """As Popen.wait: the exit code, or subprocess.TimeoutExpired after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(ZYGOTE_CMD, timeout)
            time.sleep(0.02)
        return self.returncode

    def _close_stdin(self) -> None:
        try:
            self.stdin.close()
        except OSError:
            pass


PARK = ("lazarus.cli", ["worker", "--park"])  # what a parked worker runs


class Zygote:
    """One zygote process and what it said so far. Thread-safe: the agent's loop asks for
    parked workers, its preflight thread for test processes."""

    def __init__(self, *, env: dict[str, str], log_path: Path, notes_dir: Path,
                 user: JobUser | None = None):
        """`user`: whom the zygote, and so every worker it forks, runs as (None: the
        agent's user)."""
        self.notes_dir = notes_dir
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out = rankfiles.open_log(log_path)
        try:
            self.proc = subprocess.Popen([*ZYGOTE_CMD, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True,
                                         **(user.popen_kwargs() if user else {}))
        finally:
            os.close(out)
        theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.started = time.monotonic()
        self.ready = False
        self.dead = False
        self._lock = threading.RLock()
        # requests sent, in order: [when, stdin, the worker once its pid came or None,
        # for_pool, generation]; the parked ones among them go to `take` (`for_pool`)
        self._waiting: list[list] = []
        self._forked: list[ForkedWorker] = []           # parked ones come, not yet taken
        self._codes: dict[int, int] = {}                # pid -> exit code, not yet read
        self.rehearsed: set[str] = set()                # job shapes it was asked to rehearse
        # rehearsals asked for so far: a request sent after one forks after it (the zygote
        # serves them in order), so a worker of the current generation starts warm
        self.generation = 0
        self._rehearsing_since: float | None = None  # a rehearsal asked for, not answered
        log.info("worker zygote started (pid %d)", self.proc.pid)

    @property
    def in_flight(self) -> int:
        """Parked workers asked for and not forked yet, of the current generation."""
        with self._lock:
            return sum(1 for w in self._waiting if w[3] and w[4] == self.generation)

    def stuck(self, now: float | None = None) -> bool:
        """Alive but answering nothing: not ready long after its start, or a request long
        unanswered."""
        now = time.monotonic() if now is None else now
        with self._lock:
            oldest = self._waiting[0][0] if self._waiting else None
            if self._rehearsing_since is not None:
                oldest = min(oldest or now, self._rehearsing_since)
            return not self.dead and (
                (not self.ready and now - self.started > ZYGOTE_START_S)
                or (oldest is not None and now - oldest > ZYGOTE_ANSWER_S))

    def rehearsing(self, now: float | None = None) -> bool:
        """Busy with a rehearsal (for at most ZYGOTE_ANSWER_S): the exits of its children
        are reported once it is done, not lost."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.pump()
            since = self._rehearsing_since
            return since is not None and now - since < ZYGOTE_ANSWER_S

    def spawn(self, log_path: Path) -> None:
        """Ask for one parked worker with its output in `log_path`; `take` hands it over once
        its pid came."""
        fd = rankfiles.open_log(log_path)
        try:
            self._request(*PARK, stdout=fd, stderr=fd, session=True, for_pool=True)
        finally:
            os.close(fd)

    def rehearse(self, train: dict, world_size: int) -> bool:
        """Ask for one step of the built-in trainer's job `train` on a fake world of
        `world_size` ranks (lazarus.trainer.rehearsal), unless this zygote was asked for that
        job's shape already: True when asked now. The workers it forks afterwards start with
        DTensor's caches filled; its answer only goes to the log."""
        shape = json.dumps([train.get("model"), train.get("parallelism"), train.get("data"),
                            world_size], sort_keys=True, default=str)
        with self._lock:
            if self.dead or shape in self.rehearsed:
                return False
            try:
                self.sock.send(b"rehearse " + json.dumps({"train": train,
                                                          "world_size": world_size}).encode())
            except OSError as e:
                self._gone(f"cannot ask it for a rehearsal: {e}")
                return False
            self.rehearsed.add(shape)
            self.generation += 1
            self._rehearsing_since = time.monotonic()
            return True

    def run(self, module: str, argv: list[str], *, stdout: int, stderr: int,
            wait_s: float = ZYGOTE_ANSWER_S) -> ForkedWorker | None:
        """`python -m module argv...` as a child of the zygote, with this stdout and stderr
        (descriptors; they stay open here); None if the zygote did not fork it within
        `wait_s`. Its stdin is a pipe: closing the returned worker's `stdin` is its EOF."""
        entry = self._request(module, argv, stdout=stdout, stderr=stderr, session=False,
                              for_pool=False)
        deadline = time.monotonic() + wait_s
        while entry is not None and time.monotonic() < deadline:
            with self._lock:
                self.pump()
                if entry[2] is not None or self.dead or entry not in self._waiting:
                    return entry[2]
            try:
                select.select([self.sock], [], [], 0.05)
            except (OSError, ValueError):  # closed by the agent meanwhile
                break
        if entry is not None:
            with self._lock:
                if entry[2] is None:
                    entry[1].close()  # if it forks after all: its stdin is closed, it ends
        return entry[2] if entry is not None else None

    def _request(self, module: str, argv: list[str], *, stdout: int, stderr: int,
                 session: bool, for_pool: bool) -> list | None:
        msg = b"run " + json.dumps({"module": module, "argv": argv,
                                    "session": session}).encode()
        r, w = os.pipe()
        with self._lock:
            try:
                socket.send_fds(self.sock, [msg], [r, stdout, stderr])
            except OSError as e:
                os.close(w)
                self._gone(f"cannot ask it for a process: {e}")
                return None
            finally:
                os.close(r)
            entry = [time.monotonic(), open(w, "wb", buffering=0), None, for_pool,
                     self.generation]
            self._waiting.append(entry)
            return entry

    def pump(self) -> None:
        """Read what the zygote said since the last call; never blocks."""
        with self._lock:
            while not self.dead:
                try:
                    msg = self.sock.recv(64)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as e:
                    self._gone(str(e))
                    return
                if not msg:
                    self._gone("it exited" if self.proc.poll() is not None else "it closed")
                    return
                word, _, rest = msg.decode("ascii", "replace").partition(" ")
                try:
                    self._heard(word, rest)
                except ValueError as e:
                    # It runs the job's user's code paths (--run-as): what it says is checked,
                    # and a zygote that talks nonsense is let go.
                    self._gone(f"it sent {msg[:80]!r} ({e})")
                    return

    def _heard(self, word: str, rest: str) -> None:
        """(lock held) One message of the zygote's; ValueError when malformed."""
        if word == "ready":
            self.ready = True
        elif word == "pid" and self._waiting:
            entry = self._waiting.pop(0)
            pid = int(rest)
            if pid <= 0 or not self._forked_by_it(pid):  # refused, or not its child
                entry[1].close()
                return
            entry[2] = ForkedWorker(pid, entry[1], self, self.notes_dir, entry[4])
            if entry[3]:
                self._forked.append(entry[2])
        elif word == "rehearsed":
            self._rehearsing_since = None
            log.info("worker zygote: rehearsal %s (%s)", rest, self.proc.pid)
        elif word == "exit":
            pid, _, code = rest.partition(" ")
            self._codes[int(pid)] = int(code)
            if len(self._codes) > MAX_CODES:  # codes nobody asks for: workers whose
                del self._codes[next(iter(self._codes))]  # end was read elsewhere

    def _forked_by_it(self, pid: int) -> bool:
        """Whether `pid` is a child of this zygote, of its user: the agent later signals the
        pids it takes as workers, and a zygote of the job's user (--run-as) whose code was
        tampered with could name any process on the node."""
        try:
            child, zygote = psutil.Process(pid), psutil.Process(self.proc.pid)
            ok = child.ppid() == self.proc.pid and child.uids().real == zygote.uids().real
        except psutil.Error:
            ok = False
        if not ok:
            log.warning("worker zygote (pid %d) named pid %d, not a child of its own: ignored",
                        self.proc.pid, pid)
        return ok

    def take(self) -> list[ForkedWorker]:
        """The parked workers forked since the last call."""
        with self._lock:
            self.pump()
            out, self._forked = self._forked, []
            return out

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            self.pump()
            return self._codes.pop(pid, None)

    def _gone(self, why: str) -> None:
        with self._lock:
            if not self.dead:
                log.warning("worker zygote (pid %d) gone: %s", self.proc.pid, why)
            self.dead = True
            for entry in self._waiting:  # a request it may or may not have forked: the
                entry[1].close()         # child's stdin closes, so it ends before any work
            self._waiting = []

    def close(self) -> None:
        """End the zygote (not its children: ranks outlive the agent)."""
        with self._lock:
            ready = self.ready
            self.dead = True
            self._gone("closed")
            self.sock.close()
        if not ready:  # still importing: it hears nothing until done, and has no children
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.close()
