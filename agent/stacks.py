"""The Python stacks of local workers, taken before a hung round is killed; NCCL's flight
recorder for what the collectives were doing.

Worker side: `lazarus.trainer.stackdump.enable_stack_dumps(dump_dir)` at start-up (parked workers too). It registers
faulthandler on SIGUSR1, which dumps every thread's Python stack from a C signal handler:
it answers even when the main thread is blocked inside a collective and never returns to the
interpreter, which is exactly the state of a hung rank.

Agent side: `capture(pids, dump_dir, timeout_s)` signals each worker that has the handler
installed (read from /proc, so a process without it is never killed by SIGUSR1's default
action) and returns what each one wrote.

`flight_recorder_env(dump_dir)` goes into the workers' environment: every process group,
gloo or NCCL, then keeps a ring buffer of its last collectives (TORCH_FR_BUFFER_SIZE entries).
Each worker answers a byte on its FIFO with that record as JSON
(lazarus.trainer.flightrec; `flight_records` here asks and reads, `describe_flight`
says in a line per group where the rank's collectives stand). On CUDA, NCCL also writes the
record to `<dump_dir>/nccl/nccl_trace_rank_<rank>` when its watchdog times out
(TORCH_NCCL_DUMP_ON_TIMEOUT=1, prefix TORCH_FR_DUMP_TEMP_FILE), and on demand when a
byte is written to its pipe `<dump_dir>/nccl-pipes/rank_<rank>.pipe`
(TORCH_NCCL_DEBUG_INFO_PIPE_FILE; `request_flight_recorder_dumps`). NCCL's dumps are
pickles: we collect their paths and never unpickle them; read them with
`python -m torch.distributed.flight_recorder.fr_trace <dump_dir>/nccl -p nccl_trace_rank_`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from lazarus.core import rankfiles
from lazarus.core.contract import dump_path, flight_pipe_path, flight_record_path

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
    return [pid for pid in pids if rankfiles.is_file(dump_path(dump_dir, pid))
            and handles_sigusr1(pid)]


def capture(pids: list[int], dump_dir: str | Path, timeout_s: float = 5.0) -> dict[int, str]:
    """Agent side: the stacks of each worker in `pids` that has dumps enabled (pid -> text).

    A process missing from the result either exited or never enabled dumps. `timeout_s`
    bounds the whole capture: a process that does not answer by then (stopped, or in
    uninterruptible sleep) is left out rather than holding up the recovery.
    """
    offsets = {}
    for pid in dumpable(pids, dump_dir):
        try:
            offsets[pid] = rankfiles.size(dump_path(dump_dir, pid))
            os.kill(pid, signal.SIGUSR1)
        except OSError:  # gone, or its dump file is no longer one
            offsets.pop(pid, None)
    # The handler writes the whole dump in one go; a size that stopped growing is complete.
    sizes: dict[int, int] = {}
    done: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(offsets) and time.monotonic() < deadline:
        time.sleep(0.02)
        for pid, start in offsets.items():
            if pid in done:
                continue
            try:
                size = rankfiles.size(dump_path(dump_dir, pid))
                if size > start and sizes.get(pid) == size:
                    done[pid] = rankfiles.read(dump_path(dump_dir, pid), offset=start,
                                               limit=size - start).decode("utf-8", "replace")
            except OSError:
                continue
            sizes[pid] = size
    return done


# A flight record is torch's JSON of at most FLIGHT_ENTRIES collectives, a few hundred bytes
# each: more than this is not one.
_MAX_RECORD_BYTES = 16 << 20
FLIGHT_ENTRIES = 2000


def flight_recorder_env(dump_dir: str | Path, *, entries: int = FLIGHT_ENTRIES) -> dict[str, str]:
    """Environment for workers that turns the collectives' flight recorder on, for gloo and
    NCCL process groups alike, with NCCL's dumps on its watchdog's timeout (module doc); with
    `entries` 0, off."""
    assert entries >= 0, entries
    if entries == 0:  # off, whatever the agent's own environment says
        return {"TORCH_FR_BUFFER_SIZE": "0"}
    dump_dir = Path(dump_dir)
    (dump_dir / "nccl").mkdir(parents=True, exist_ok=True)
    (dump_dir / "nccl-pipes").mkdir(parents=True, exist_ok=True)
    # torch's current names (the TORCH_NCCL_ ones of the buffer and the file are deprecated
    # aliases, warned about in every process); the timeout dump and the pipe are NCCL's alone
    return {"TORCH_FR_BUFFER_SIZE": str(entries),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(dump_dir / "nccl" / _FR_PREFIX),
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(dump_dir / "nccl-pipes" / "rank_")}


def request_flight_recorder_dumps(dump_dir: str | Path, ranks: list[int]) -> list[int]:
    """Ask the NCCL process groups of `ranks` to dump now; returns the ranks asked (a rank
    without a pipe, or whose reader is gone, is skipped)."""
    asked = []
    for rank in ranks:
        pipe = Path(dump_dir) / "nccl-pipes" / f"rank_{rank}.pipe"
        try:
            rankfiles.poke_pipe(pipe)
        except OSError:  # no such pipe, ENXIO: nobody reads it, or not a pipe of ours
            continue
        asked.append(rank)
    return asked


def collect_flight_recorder(dump_dir: str | Path) -> dict[int, Path]:
    """The flight recorder dumps present: rank -> file."""
    out = {}
    for path in sorted((Path(dump_dir) / "nccl").glob(_FR_PREFIX + "*")):
        suffix = path.name[len(_FR_PREFIX):]
        if suffix.isdigit():
            out[int(suffix)] = path
    return out


def ask_flight_records(pids: list[int], dump_dir: str | Path) -> list[int]:
    """Ask each worker in `pids` for its flight record (lazarus.trainer.flightrec); returns
    the pids asked. An older record of theirs is removed first, so what `flight_records`
    reads is the answer."""
    asked = []
    for pid in pids:
        try:
            flight_record_path(dump_dir, pid).unlink(missing_ok=True)
            # ENXIO rather than a wait when nobody reads (no such worker thread)
            rankfiles.poke_pipe(flight_pipe_path(dump_dir, pid))
        except OSError:
            continue
        asked.append(pid)
    return asked


def flight_records(asked: list[int], dump_dir: str | Path, timeout_s: float) -> dict[int, bytes]:
    """The flight records of the workers `ask_flight_records` asked (pid -> torch's JSON),
    waiting up to `timeout_s` for them: a stopped worker, or one holding the GIL, never
    answers and is left out."""
    out: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in asked:
            path = flight_record_path(dump_dir, pid)
            if pid in out or not rankfiles.is_file(path):
                continue
            try:
                out[pid] = rankfiles.read(path, limit=_MAX_RECORD_BYTES + 1)
            except OSError:
                continue
        if len(out) == len(asked) or time.monotonic() >= deadline:
            return out
        time.sleep(0.02)


def describe_flight(raw: bytes) -> str:
    """Where one worker's collectives stand, from its flight record: per process group the
    last collective enqueued and completed, and the newest one's operation, e.g.
    "pg 0 (default_pg): #57 all_reduce enqueued, #56 completed". The record comes from a
    process running the job's code: anything malformed is said to be, never raised."""
    if len(raw) > _MAX_RECORD_BYTES:
        return "flight record too large to read"
    try:
        doc = json.loads(raw)
        status = doc.get("pg_status") or {}
        newest: dict[str, tuple[int, str, str]] = {}
        for e in doc.get("entries") or []:
            pg = str(e.get("pg_id"))
            seq = int(e.get("collective_seq_id") or 0)
            if seq >= newest.get(pg, (-1, "", ""))[0]:
                names = e.get("process_group") or ["", ""]
                newest[pg] = (seq, str(e.get("profiling_name", "")).rpartition(":")[2],
                              str(names[1] if len(names) > 1 else ""))
        parts = []
        for pg in sorted(status, key=lambda k: (len(k), k)):
            st = status[pg]
            enq, done = int(st.get("last_enqueued_collective", -1)), \
                int(st.get("last_completed_collective", -1))
            seq, op, name = newest.get(pg, (-1, "", ""))
            what = f" {op}" if seq == enq and op else ""
            named = f" ({name})" if name and name != "undefined" else ""
            parts.append(f"pg {pg}{named}: #{enq}{what} enqueued, "
                         f"#{done} completed")
        return "; ".join(parts) or "no collectives recorded"
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        return f"flight record unreadable ({type(e).__name__})"
