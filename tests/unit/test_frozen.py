"""Frozen ranks (lazarus.agent.frozen): real processes stopped with SIGSTOP read as stopped,
running ones never do, and a frozen rank is the cluster's culprit alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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
