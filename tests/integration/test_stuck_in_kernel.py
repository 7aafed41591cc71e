"""A rank stuck in the kernel on a mount that never answers (tests/integration/stuckfs.py: a
real FUSE filesystem whose reads are never answered) is named for what it is: its main
thread in D, where it sleeps and on which file -- even though another of its threads answers
the stack dump. One that SIGKILL cannot end says so."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lazarus.agent import frozen, hangreport
from lazarus.agent.hang import HangConfig, HangDetector
from lazarus.agent.stacks import capture, dumpable
from lazarus.agent.workers import Group
from lazarus.core.contract import STACK_CAPTURE_S, HangVerdict, Progress
from lazarus.core.culprits import combine

HELPER = Path(__file__).with_name("stuckfs.py")


class StuckFs:
    def __init__(self, proc: subprocess.Popen, mnt: Path):
        self.proc, self.mnt = proc, mnt
        self.pids: list[int] = []

    def start(self, what: str) -> int:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line.startswith("pid "), line
        self.pids.append(int(line.split()[1]))
        return self.pids[-1]


@pytest.fixture
def stuckfs(tmp_path):
    if not os.path.exists("/dev/fuse") or shutil.which("unshare") is None:
        pytest.skip("no /dev/fuse or no unshare(1) here")
    mnt, dumps = tmp_path / "mnt", tmp_path / "dumps"
    mnt.mkdir()
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                             str(HELPER), str(mnt), str(dumps)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "mounted":
        proc.kill()
        pytest.skip(f"cannot mount a FUSE filesystem here: {proc.communicate()[1].strip()}")
    fs = StuckFs(proc, mnt)
    try:
        yield fs
    finally:
        # its /dev/fuse closed, the kernel aborts the mount's requests: the waits end
        proc.stdin.close()
        proc.wait()
        for pid in fs.pids:
            _until(lambda pid=pid: frozen.sample(pid).state in ("", "Z"), f"pid {pid} ends",
                   kill=pid)


def _until(pred, what: str, timeout_s: float = 30.0, kill: int | None = None):
    """Until `pred()` holds (the kernel's states change asynchronously to us)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if kill is not None:
            try:
                os.kill(kill, signal.SIGKILL)
            except ProcessLookupError:
                return True
        time.sleep(0.02)
    raise AssertionError(f"never: {what}")


def _in_d(pid: int) -> frozen.ProcSample:
    return _until(lambda: (s := frozen.sample(pid)).state == "D" and s, f"pid {pid} in D")


def test_a_rank_reading_a_mount_that_never_answers_is_stuck_in_the_kernel(stuckfs, tmp_path):
    pid = stuckfs.start("read")
    _in_d(pid)
    # as the agent's hang report takes it (lazarus.agent.hangreport)
    dumps = tmp_path / "dumps"
    asked = dumpable([pid], dumps)
    taken_at = time.monotonic()
    before = frozen.samples([pid])
    dump = capture([pid], dumps, timeout_s=STACK_CAPTURE_S)
    after = frozen.settled([pid], before, taken_at)

    # the stack dump was answered, by another thread: the main thread's frame is in it
    assert asked == [pid] and "in <module>" in dump[pid], dump
    main = after[pid]
    assert main.state == "D" and main.threads[0] == "D" and "D" not in main.threads[1:], main
    got = frozen.frozen({1: pid}, before, after, answered=dump, asked=asked)
    data = str(stuckfs.mnt / "data")
    assert got[1].startswith("stuck in the kernel (wchan "), got
    assert got[1].endswith(f", reading {data})"), got
    # a wait a SIGKILL ends: not unkillable, and it ends
    assert frozen.unkillable(pid) is None
    os.kill(pid, signal.SIGKILL)
    _until(lambda: frozen.sample(pid).state in ("", "Z"), "the killed rank ends")


def test_a_process_that_sigkill_cannot_end_is_named_so(stuckfs):
    reader = stuckfs.start("read")
    _in_d(reader)  # its read is pending: the file's page stays locked
    opener = stuckfs.start("open")
    _in_d(opener)
    assert frozen.unkillable(opener) is None  # nobody asked it to end yet
    os.kill(opener, signal.SIGKILL)
    # the SIGKILL is pending at once, and the wait it cannot end holds the process in D
    why = frozen.unkillable(opener)
    data = str(stuckfs.mnt / "data")
    assert why is not None and why.startswith("stuck in the kernel (wchan "), why
    assert why.endswith(f", opening {data}); SIGKILL cannot end it"), why


def test_the_hang_event_names_the_kernel_wait_not_a_collective(stuckfs, tmp_path):
    """The incident as it was met: a level-0 script whose rank 1 (node n1) read a file on a
    mount that never answers, caught after the 20 s first-step allowance, while rank 0 (n0)
    waited in its 66th collective."""
    pid = stuckfs.start("read")
    _in_d(pid)
    now = time.monotonic()
    detectors = {}
    for node, rank, seq in (("n0", 0, 66), ("n1", 1, 65)):
        detectors[node] = HangDetector(HangConfig(first_step_timeout_s=20.0))
        detectors[node].observe(rank, Progress(step=0, phase="collective", seq=seq,
                                               since=now - 21.0))
    n1 = SimpleNamespace(cfg=SimpleNamespace(stacks_dir=tmp_path / "dumps", workdir=tmp_path,
                                             node="n1"),
                         report=SimpleNamespace(hang=None))
    hangreport.report(n1, Group(round=3, procs={0: SimpleNamespace(pid=pid)}, ranks={0: 1}),
                      detectors["n1"].check(now))

    data = str(stuckfs.mnt / "data")
    reports = {"n0": detectors["n0"].check(now), "n1": HangVerdict.from_dict(n1.report.hang)}
    hang = combine(reports)
    assert hang.culprit_nodes == ("n1",) and hang.culprit_ranks == (1,)
    assert hang.reason.startswith("node n1: rank 1 is frozen (stuck in the kernel (wchan ")
    assert hang.reason.endswith(f", reading {data}))") and "collective" not in hang.reason
    # the stacks file says it beside the stack another thread gave
    stacks = Path(n1.report.hang["stacks"]).read_text()
    assert "frozen: stuck in the kernel (wchan " in stacks and "in <module>" in stacks


class _Rank:
    """A process as the agent's Workers hold one (poll, send_signal, pid)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return -signal.SIGKILL if frozen.sample(self.pid).state in ("", "Z") else None

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def test_the_agent_sets_aside_a_rank_sigkill_cannot_end_and_goes_on(stuckfs, tmp_path,
                                                                     monkeypatch):
    """Stopping a round used to wait for every killed rank: one that SIGKILL cannot end froze
    the agent's loop for good (lazarus.agent.workers.Workers._kill)."""
    from lazarus.agent import workers as workers_mod

    reader = stuckfs.start("read")
    _in_d(reader)
    opener = stuckfs.start("open")
    _in_d(opener)
    monkeypatch.setattr(workers_mod, "KILL_WAIT_S", 1.0)
    w = workers_mod.Workers(nproc=1, env={}, log_dir=tmp_path / "logs", notes_dir=tmp_path,
                            park=False)
    done = threading.Event()
    t = threading.Thread(target=lambda: (w._kill([_Rank(opener)]), done.set()), daemon=True)
    t.start()
    t.join(timeout=30)  # a hang guard, not a timing
    assert done.is_set(), "the agent still waits for a process SIGKILL cannot end"
    assert "SIGKILL cannot end it" in w.unkillable[opener][1], w.unkillable
    # the mount goes away, the wait ends: the next poll reaps it
    stuckfs.proc.stdin.close()
    stuckfs.proc.wait()
    _until(lambda: (w.poll() or True) and opener not in w.unkillable, "the set-aside rank reaped")
