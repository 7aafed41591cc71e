"""The Python stacks of local workers, taken before a hung round is killed; NCCL's flight
recorder for what the collectives were doing.

Worker side: `lazarus.trainer.stackdump.enable_stack_dumps(dump_dir)` at start-up (parked workers too). It registers
faulthandler on SIGUSR1, which dumps every thread's Python stack from a C signal handler:
it answers even when the main thread is blocked inside a collective and never returns to the
interpreter, which is exactly the state of a hung rank.

Agent side: `capture(pids, dump_dir, timeout_s)` signals each worker that has the handler
installed (read from /proc, so a process without it is never killed by SIGUSR1's default
action) and returns what each one wrote.

On CUDA, `nccl_flight_recorder_env(dump_dir)` goes into the workers' environment: every
process group then keeps a ring buffer of its last collectives (TORCH_NCCL_TRACE_BUFFER_SIZE
entries), writes it to `<dump_dir>/nccl/nccl_trace_rank_<rank>` when its watchdog times out
(TORCH_NCCL_DUMP_ON_TIMEOUT=1, prefix TORCH_NCCL_DEBUG_INFO_TEMP_FILE), and also on demand
when a byte is written to its pipe `<dump_dir>/nccl-pipes/rank_<rank>.pipe`
(TORCH_NCCL_DEBUG_INFO_PIPE_FILE; `request_flight_recorder_dumps`). The dumps are pickles:
we collect their paths and never unpickle them; read them with
`python -m torch.distributed.flight_recorder.fr_trace <dump_dir>/nccl -p nccl_trace_rank_`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lazarus.core.contract import dump_path

_FR_PREFIX = "nccl_trace_rank_"


def handles_sigusr1(pid: int) -> bool:
    """Whether `pid` catches SIGUSR1 (its SigCgt mask in /proc); False if it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return False


def dumpable(pids: list[int], dump_dir: str | Path) -> list[int]:
    """The pids among `pids` that answer SIGUSR1 with a dump: `capture` asks only those, and
    one of them that stays silent is not running (lazarus.agent.frozen)."""
    return [pid for pid in pids if dump_path(dump_dir, pid).exists() and handles_sigusr1(pid)]


def capture(pids: list[int], dump_dir: str | Path, timeout_s: float = 5.0) -> dict[int, str]:
    """Agent side: the stacks of each worker in `pids` that has dumps enabled (pid -> text).

    A process missing from the result either exited or never enabled dumps. `timeout_s`
    bounds the whole capture: a process that does not answer by then (stopped, or in
    uninterruptible sleep) is left out rather than holding up the recovery.
    """
    offsets = {}
    for pid in dumpable(pids, dump_dir):
        offsets[pid] = dump_path(dump_dir, pid).stat().st_size
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            del offsets[pid]
    # The handler writes the whole dump in one go; a size that stopped growing is complete.
    sizes: dict[int, int] = {}
    done: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(offsets) and time.monotonic() < deadline:
        time.sleep(0.02)
        for pid, start in offsets.items():
            if pid in done:
                continue
            size = dump_path(dump_dir, pid).stat().st_size
            if size > start and sizes.get(pid) == size:
                with open(dump_path(dump_dir, pid), encoding="utf-8", errors="replace") as f:
                    f.seek(start)
                    done[pid] = f.read()
            sizes[pid] = size
    return done


def nccl_flight_recorder_env(dump_dir: str | Path, *, entries: int = 2000) -> dict[str, str]:
    """Environment for CUDA workers that turns NCCL's flight recorder on (see the module doc)."""
    dump_dir = Path(dump_dir)
    (dump_dir / "nccl").mkdir(parents=True, exist_ok=True)
    (dump_dir / "nccl-pipes").mkdir(parents=True, exist_ok=True)
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(dump_dir / "nccl" / _FR_PREFIX),
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(dump_dir / "nccl-pipes" / "rank_")}


def request_flight_recorder_dumps(dump_dir: str | Path, ranks: list[int]) -> list[int]:
    """Ask the NCCL process groups of `ranks` to dump now; returns the ranks asked (a rank
    without a pipe, or whose reader is gone, is skipped)."""
    asked = []
    for rank in ranks:
        pipe = Path(dump_dir) / "nccl-pipes" / f"rank_{rank}.pipe"
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no such pipe, or ENXIO: nobody reads it
            continue
        try:
            os.write(fd, b"1")
            asked.append(rank)
        finally:
            os.close(fd)
    return asked


def collect_flight_recorder(dump_dir: str | Path) -> dict[int, Path]:
    """The flight recorder dumps present: rank -> file."""
    out = {}
    for path in sorted((Path(dump_dir) / "nccl").glob(_FR_PREFIX + "*")):
        suffix = path.name[len(_FR_PREFIX):]
        if suffix.isdigit():
            out[int(suffix)] = path
    return out
