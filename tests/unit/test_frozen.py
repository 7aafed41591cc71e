"""Frozen ranks (lazarus.agent.frozen): real processes stopped with SIGSTOP read as stopped,
running ones never do, and a frozen rank is the cluster's culprit alone."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lazarus.agent import frozen
from lazarus.core.contract import HangVerdict, Position
from lazarus.core.culprits import combine


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    yield proc
    proc.kill()
    proc.wait()


RUNNING = ("S", "R")  # asleep between its sleeps, or running


def _state_becomes(pid: int, states: tuple[str, ...]) -> frozen.ProcSample:
    """The process's sample once its state is one of `states` (a signal is delivered
    asynchronously); the test fails when it never is."""
    for _ in range(200):
        s = frozen.sample(pid)
        if s.state in states:
            return s
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} is in state {s.state!r}, never one of {states}")


def test_a_stopped_process_is_frozen_and_a_running_one_is_not(child):
    ranks = {1: child.pid}
    live = _state_becomes(child.pid, RUNNING)
    assert frozen.frozen(ranks, {child.pid: live}, {child.pid: live}, [], []) == {}
    os.kill(child.pid, signal.SIGSTOP)
    stopped = _state_becomes(child.pid, ("T",))
    got = frozen.frozen(ranks, {child.pid: live}, {child.pid: stopped}, [], [])
    assert got == {1: "stopped (SIGSTOP or a debugger)"}
    os.kill(child.pid, signal.SIGCONT)
    assert frozen.frozen(ranks, {}, {child.pid: _state_becomes(child.pid, RUNNING)}, [], []) == {}


def test_silence_to_the_stack_dump_is_frozen_and_an_answer_is_not():
    s = frozen.ProcSample("S", 1.0)
    ranks = {0: 100, 1: 101}
    got = frozen.frozen(ranks, {100: s, 101: s}, {100: frozen.ProcSample("S", 2.0), 101: s},
                        answered=[100], asked=[100, 101])
    assert got == {1: "did not answer the stack dump; its CPU time stopped while its peers' ran"}
    # a process that never installed the handler was not asked: its silence says nothing
    assert frozen.frozen(ranks, {100: s, 101: s}, {100: s, 101: s}, [100], [100]) == {}
    # a process gone is an exit, reported as such elsewhere
    assert frozen.frozen({1: 101}, {}, {101: frozen.ProcSample("", 0.0)}, [], [101]) == {}
    assert frozen.sample(2**22 + 12345).state == ""


def test_a_frozen_rank_names_its_node_alone_even_when_level_with_the_others():
    level = Position(step=7, phase="collective", seq=70, stalled_s=12.0, op="all_reduce")
    reports = {
        "n0": HangVerdict(culprits=(), reason="...", stalled_s=12.0, timeout_s=10.0,
                          positions={0: level}),
        "n1": HangVerdict(culprits=(1,), reason="...", stalled_s=12.0, timeout_s=10.0,
                          positions={1: level}, frozen={1: "stopped (SIGSTOP or a debugger)"}),
    }
    hang = combine(reports)
    assert hang.culprit_nodes == ("n1",) and hang.culprit_ranks == (1,)
    assert "rank 1 is frozen (stopped" in hang.reason
    # the report travels as JSON in the node status
    back = HangVerdict.from_dict(reports["n1"].to_dict())
    assert back.frozen == {1: "stopped (SIGSTOP or a debugger)"}
    # without the evidence, level ranks name nobody (the old answer: both nodes blamed)
    assert combine({n: HangVerdict(culprits=(), reason="", stalled_s=1, timeout_s=1,
                                   positions=v.positions) for n, v in reports.items()}
                   ).culprit_nodes == ()


# The system call numbers of read(2) where the agent runs (the kernel's own tables).
READ_NR = {"x86_64": 0, "aarch64": 63}.get(platform.machine())


def _task(root: Path, pid: int, tid: int, state: str, cpu_ticks: int, **files: str) -> None:
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True)
    (task / "stat").write_text(f"{tid} (python (rank)) {state} 1 1 1 0 -1 0 0 0 0 0 "
                               f"{cpu_ticks} 0 0 0 20 0 3 0\n")
    for name, text in files.items():
        (task / name).write_text(text)


def _proc(root: Path, pid: int, *, main: str, pending: str = "0") -> Path:
    """A /proc tree of one process: its main thread in `main` state, reading descriptor 7
    (a file on a dead NFS mount), and a second thread asleep."""
    _task(root, pid, pid, main, 50,
          syscall=f"{READ_NR} 0x7 0x7f00 0x1000 0x0 0x0 0x0 0x7ffd 0x7f01\n",
          status=f"Name:\tpython\nSigPnd:\t{pending}\nShdPnd:\t0000000000000000\n")
    _task(root, pid, pid + 1, "S", 7)
    (root / str(pid) / "stat").write_text((root / str(pid) / "task" / str(pid) / "stat")
                                          .read_text().replace(" 50 0 0 0", " 57 0 0 0"))
    (root / str(pid) / "wchan").write_text("nfs_wait_bit_killable")
    (root / str(pid) / "fd").mkdir()
    os.symlink("/mnt/nfs/shard-3.bin", root / str(pid) / "fd" / "7")
    return root


@pytest.mark.skipif(READ_NR is None, reason="read(2)'s number is known on x86_64 and aarch64")
def test_a_main_thread_that_stays_in_d_is_stuck_in_the_kernel_and_says_where(tmp_path):
    """The kernel's side as /proc shows it (a real one: tests/integration/test_stuck_in_kernel.py,
    where FUSE mounts): the main thread in D reading a file, another thread free to answer the
    stack dump."""
    proc = _proc(tmp_path / "proc", 4242, main="D")
    s = frozen.sample(4242, proc)
    assert s.state == "D" and s.threads == "DS" and s.main_cpu_s < s.cpu_s
    assert s.where == "wchan nfs_wait_bit_killable, reading /mnt/nfs/shard-3.bin"
    # the dump answered (by the other thread), yet the main thread stayed in D, not running
    assert frozen.frozen({1: 4242}, {4242: s}, {4242: s}, answered=[4242], asked=[4242]) == {
        1: "stuck in the kernel (wchan nfs_wait_bit_killable, reading /mnt/nfs/shard-3.bin)"}
    # in D once, or running in between: a write that sleeps a moment, not a stuck rank
    ran = frozen.ProcSample("D", s.cpu_s + 1, s.main_cpu_s + 1, "DS", s.where)
    assert frozen.frozen({1: 4242}, {4242: s}, {4242: ran}, [4242], [4242]) == {}
    assert frozen.frozen({1: 4242}, {}, {4242: s}, [4242], [4242]) == {}
    # asked to die and still there with the SIGKILL pending: a wait no signal ends
    assert frozen.unkillable(4242, proc) is None
    killed = _proc(tmp_path / "killed", 4242, main="D", pending=f"{1 << (signal.SIGKILL - 1):016x}")
    assert frozen.unkillable(4242, killed) == (
        "stuck in the kernel (wchan nfs_wait_bit_killable, reading /mnt/nfs/shard-3.bin); "
        "SIGKILL cannot end it")


def test_where_a_real_thread_sleeps_is_read_from_its_system_call(tmp_path):
    """/proc's syscall and fd files of a real process blocked in a read of a pipe."""
    r, w = os.pipe()
    reader = subprocess.Popen([sys.executable, "-c", f"import os; os.read({r}, 1)"],
                              pass_fds=(r,))
    os.close(r)
    try:
        got = ""
        for _ in range(200):  # its interpreter starts first: until it sits in the read
            got = frozen.where(reader.pid)
            if "reading pipe:" in got:
                break
            time.sleep(0.01)
        assert "reading pipe:[" in got, got
    finally:
        os.close(w)
        reader.wait()
