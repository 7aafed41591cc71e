"""Which of a node's hung ranks is frozen: the evidence that names a culprit alone.

A rank stopped by SIGSTOP (or a debugger), or asleep in an uninterruptible driver call or
I/O, looks from its progress records exactly like its peers waiting for it: everyone stopped
at the same step. What tells them apart is the process itself, read by the agent when it
takes the stacks (lazarus.agent.stacks.capture):

- its state in /proc/<pid>/stat: T or t (stopped, traced) -- it runs no code at all; D
  (uninterruptible sleep) -- it is stuck in the kernel, in a driver or a filesystem;
- it did not answer the stack dump: faulthandler answers SIGUSR1 from a C signal handler
  even while the interpreter is blocked in a collective, so a rank that has the handler and
  stays silent is not running;
- its CPU time did not move during the capture, while another local rank's did (on NCCL a
  waiting rank spins; on gloo everyone sleeps, so this one only speaks when peers burn CPU).

Peers waiting in a collective are in S (or R, spinning) and answer the dump: never frozen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_STATES = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a tracer",
           "D": "in uninterruptible sleep (a driver call or I/O)"}
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcSample:
    state: str          # the one-letter state of /proc/<pid>/stat; "" when the pid is gone
    cpu_s: float        # user + system time so far


def sample(pid: int) -> ProcSample:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return ProcSample("", 0.0)
    # The command name (field 2) is in parentheses and may itself hold spaces or ')'.
    fields = text[text.rfind(")") + 2:].split()
    try:
        return ProcSample(fields[0], (int(fields[11]) + int(fields[12])) * _TICK_S)
    except (IndexError, ValueError):
        return ProcSample("", 0.0)


def samples(pids: Iterable[int]) -> dict[int, ProcSample]:
    return {pid: sample(pid) for pid in pids}


def frozen(ranks: Mapping[int, int], before: Mapping[int, ProcSample],
           after: Mapping[int, ProcSample], answered: Iterable[int],
           asked: Iterable[int]) -> dict[int, str]:
    """Global rank -> why it is frozen, for the ranks (rank -> pid) of one node around a stack
    capture: `before`/`after` its samples, `asked` the pids signalled for a dump (those with
    the handler), `answered` those that wrote one."""
    answered, asked = set(answered), set(asked)
    burning = {pid for pid in ranks.values()
               if pid in before and pid in after and after[pid].cpu_s > before[pid].cpu_s}
    out = {}
    for rank, pid in ranks.items():
        now = after.get(pid)
        if now is None or now.state in ("", "Z", "X"):
            continue  # gone: an exit, which the workers' poll reports as a crash
        why = []
        if now.state in _STATES:
            why.append(_STATES[now.state])
        silent = pid in asked and pid not in answered
        if silent:
            why.append("did not answer the stack dump")
        if burning and pid not in burning and (silent or now.state in _STATES):
            why.append("its CPU time stopped while its peers' ran")
        # A D state alone can be a slow write that ends in a moment: with the dump
        # unanswered as well, it is not moving.
        if now.state in ("T", "t") or silent:
            out[rank] = "; ".join(why)
    return out
