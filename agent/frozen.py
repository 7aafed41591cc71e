"""Which of a node's hung ranks is frozen: the evidence that names a culprit alone.

A rank stopped by SIGSTOP (or a debugger), or asleep in an uninterruptible driver call or
I/O, looks from its progress records exactly like its peers waiting for it: everyone stopped
at the same step. What tells them apart is the process itself, read by the agent when it
takes the stacks (lazarus.agent.stacks.capture):

- the state of its main thread (/proc/<pid>/task/<pid>/stat), where the script runs: T or t
  (stopped, traced) -- it runs no code at all; D (uninterruptible sleep) at both samples
  around the capture, with the main thread's CPU time still -- it is stuck in the kernel, in
  a driver or a filesystem (a mount that never answers). The other threads may run: one of
  them answers the stack dump (faulthandler's handler runs on whichever thread takes the
  signal), so an answer does not clear a main thread stuck in D. Where it sleeps is said:
  its wchan, and the file when its system call (/proc/<pid>/task/<pid>/syscall) takes a
  descriptor (/proc/<pid>/fd/N) or a path;
- it did not answer the stack dump: faulthandler answers SIGUSR1 from a C signal handler
  even while the interpreter is blocked in a collective, so a rank that has the handler and
  stays silent is not running;
- its CPU time did not move during the capture, while another local rank's did (on NCCL a
  waiting rank spins; on gloo everyone sleeps, so this one only speaks when peers burn CPU).

Peers waiting in a collective sleep in S (or spin in R) and answer the dump: never frozen.

A SIGKILL ends a wait in D that is killable (a page of a file being read) but not every one:
an NFS hard mount, or a FUSE request its server took and never answers, holds the process in
the kernel with the SIGKILL pending until the server answers (`unkillable`).
"""

from __future__ import annotations

import os
import platform
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_STOPPED = {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a tracer"}
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
# A main thread in D at two samples this far apart, its CPU time still, is not passing I/O.
IN_KERNEL_S = 1.0
_PATH_MAX = 4096

# System calls a stuck main thread is most often in, by number (x86_64 and aarch64): what it
# does, and which argument names the file -- ("fd", i) a descriptor, ("path", i) a pointer to
# its name.
_SYSCALLS = {
    "x86_64": {0: ("reading", ("fd", 0)), 1: ("writing", ("fd", 0)),
               2: ("opening", ("path", 0)), 4: ("stat of", ("path", 0)),
               5: ("stat of", ("fd", 0)), 6: ("stat of", ("path", 0)),
               16: ("ioctl on", ("fd", 0)), 17: ("reading", ("fd", 0)),
               18: ("writing", ("fd", 0)), 19: ("reading", ("fd", 0)),
               20: ("writing", ("fd", 0)), 74: ("syncing", ("fd", 0)),
               75: ("syncing", ("fd", 0)), 217: ("listing", ("fd", 0)),
               257: ("opening", ("path", 1)), 262: ("stat of", ("path", 1)),
               295: ("reading", ("fd", 0)), 296: ("writing", ("fd", 0)),
               332: ("stat of", ("path", 1))},
    "aarch64": {29: ("ioctl on", ("fd", 0)), 56: ("opening", ("path", 1)),
                61: ("listing", ("fd", 0)), 63: ("reading", ("fd", 0)),
                64: ("writing", ("fd", 0)), 65: ("reading", ("fd", 0)),
                66: ("writing", ("fd", 0)), 67: ("reading", ("fd", 0)),
                68: ("writing", ("fd", 0)), 69: ("reading", ("fd", 0)),
                70: ("writing", ("fd", 0)), 79: ("stat of", ("path", 1)),
                80: ("stat of", ("fd", 0)), 82: ("syncing", ("fd", 0)),
                83: ("syncing", ("fd", 0)), 291: ("stat of", ("path", 1))},
}.get(platform.machine(), {})


@dataclass(frozen=True, slots=True)
class ProcSample:
    state: str              # the main thread's one-letter state; "" when the pid is gone
    cpu_s: float            # user + system time so far, of every thread
    main_cpu_s: float = 0.0  # ... of the main thread alone
    threads: str = ""       # every thread's state, the main thread's first
    where: str = ""         # a main thread in D: where it sleeps ("wchan X, reading FILE")


def _stat(path: Path) -> tuple[str, float] | None:
    """(state, user + system seconds) of one /proc stat file."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ')'.
    fields = text[text.rfind(")") + 2:].split()
    try:
        return fields[0], (int(fields[11]) + int(fields[12])) * _TICK_S
    except (IndexError, ValueError):
        return None


def sample(pid: int, proc: Path = PROC) -> ProcSample:
    tasks = proc / str(pid) / "task"
    whole, main = _stat(proc / str(pid) / "stat"), _stat(tasks / str(pid) / "stat")
    if whole is None or main is None:
        return ProcSample("", 0.0)
    try:
        others = sorted(int(t) for t in os.listdir(tasks) if t.isdigit() and int(t) != pid)
    except OSError:
        others = []
    states = [got[0] for got in (_stat(tasks / str(tid) / "stat") for tid in others) if got]
    return ProcSample(main[0], whole[1], main[1], main[0] + "".join(states),
                      where(pid, proc) if main[0] == "D" else "")


def samples(pids: Iterable[int], proc: Path = PROC) -> dict[int, ProcSample]:
    return {pid: sample(pid, proc) for pid in pids}


def where(pid: int, proc: Path = PROC) -> str:
    """Where the main thread of `pid` sleeps in the kernel, as far as /proc says: "wchan
    folio_wait_bit_common, reading /mnt/data/shard-3.bin"; "" when it says nothing."""
    task = proc / str(pid) / "task" / str(pid)
    parts = []
    try:
        wchan = (proc / str(pid) / "wchan").read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        wchan = ""
    if wchan and wchan != "0":
        parts.append(f"wchan {wchan[:80]}")
    try:
        # "NR ARG1 ... ARG6 SP PC", "-1 SP PC" outside a call (a page fault), or "running";
        # reading it takes the ptrace access the agent has over its own workers
        call = (task / "syscall").read_text(encoding="ascii", errors="replace").split()
    except OSError:
        call = []
    if call and call[0] == "-1":
        parts.append("outside a system call (a page fault)")
    elif call and call[0].isdigit():
        parts.append(_doing(pid, int(call[0]), call[1:7], proc))
    return ", ".join(parts)


def _doing(pid: int, nr: int, args: list[str], proc: Path) -> str:
    if nr not in _SYSCALLS:
        return f"in system call {nr}"
    verb, (kind, i) = _SYSCALLS[nr]
    try:
        arg = int(args[i], 16)
    except (IndexError, ValueError):
        return f"{verb} a file"
    if kind == "fd":
        try:
            return f"{verb} {_shown(os.readlink(proc / str(pid) / 'fd' / str(arg)))}"
        except OSError:
            return f"{verb} descriptor {arg}"
    name = _string_at(pid, arg, proc)
    return f"{verb} {_shown(name)}" if name else f"{verb} a file"


def _shown(name: str) -> str:
    # The job's code names its files: one line of printable text, bounded, in a report.
    return "".join(c if c.isprintable() else "?" for c in name[:200])


def _string_at(pid: int, address: int, proc: Path) -> str | None:
    """The NUL-ended string at `address` in `pid`'s memory (a path it passed to the kernel)."""
    try:
        with open(proc / str(pid) / "mem", "rb", buffering=0) as f:
            f.seek(address)
            raw = f.read(_PATH_MAX)
    except (OSError, ValueError, OverflowError):
        return None
    return raw.partition(b"\0")[0].decode("utf-8", "replace") or None


def settled(pids: Iterable[int], before: Mapping[int, ProcSample], taken_at: float,
            proc: Path = PROC) -> dict[int, ProcSample]:
    """The samples that close a capture whose `before` was taken at `taken_at`
    (time.monotonic()): when a main thread was in D then, no sooner than IN_KERNEL_S after it
    -- the capture may end sooner, its dump answered by another thread -- so that a write
    that sleeps a few milliseconds is not named."""
    pids = list(pids)
    if any(before.get(pid, ProcSample("", 0.0)).state == "D" for pid in pids):
        time.sleep(max(0.0, taken_at + IN_KERNEL_S - time.monotonic()))
    return samples(pids, proc)


def in_kernel(prior: ProcSample | None, now: ProcSample) -> bool:
    """The main thread stayed in D from `prior` to `now`, without running in between."""
    return (prior is not None and prior.state == "D" and now.state == "D"
            and now.main_cpu_s == prior.main_cpu_s)


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
        stuck = in_kernel(before.get(pid), now)
        why = []
        if now.state in _STOPPED:
            why.append(_STOPPED[now.state])
        elif stuck:
            why.append(f"stuck in the kernel ({now.where})" if now.where
                       else "stuck in the kernel")
        elif now.state == "D":
            why.append("in uninterruptible sleep (a driver call or I/O)")
        silent = pid in asked and pid not in answered
        if silent:
            why.append("did not answer the stack dump")
        if burning and pid not in burning and (silent or now.state in ("T", "t", "D")):
            why.append("its CPU time stopped while its peers' ran")
        # A D state seen once can be a write that ends in a moment: it takes the main thread
        # in D at both samples, or the dump unanswered as well.
        if now.state in _STOPPED or stuck or silent:
            out[rank] = "; ".join(why)
    return out


def unkillable(pid: int, proc: Path = PROC) -> str | None:
    """Why `pid`, sent a SIGKILL, is still there: its main thread sleeps in D with the SIGKILL
    pending, in a wait that no signal ends. None when it is gone or free to die (a killable
    wait is woken by the SIGKILL at once: ask only after giving it a moment)."""
    now = sample(pid, proc)
    if now.state != "D" or not _pending(pid, signal.SIGKILL, proc):
        return None
    return (f"stuck in the kernel ({now.where})" if now.where else "stuck in the kernel") + \
        "; SIGKILL cannot end it"


def _pending(pid: int, sig: int, proc: Path) -> bool:
    """Whether `sig` waits to be delivered to the main thread of `pid` (its own or the
    process's pending set)."""
    try:
        lines = (proc / str(pid) / "task" / str(pid) / "status").read_text(
            encoding="ascii", errors="replace").splitlines()
    except OSError:
        return False
    for line in lines:
        name, _, mask = line.partition(":")
        if name in ("SigPnd", "ShdPnd"):
            try:
                if int(mask.strip(), 16) >> (sig - 1) & 1:
                    return True
            except ValueError:
                continue
    return False
