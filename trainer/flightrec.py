"""A worker's side of the collectives' flight recorder: torch's record of the last collectives
of every process group (gloo and NCCL alike), dumped as JSON when the agent asks.

The agent turns the recorder on through the workers' environment (TORCH_FR_BUFFER_SIZE,
lazarus.agent.stacks.flight_recorder_env) and, when a round hangs, writes a byte to each
worker's FIFO (lazarus.core.contract.flight_pipe_path). A thread of ours blocked on that FIFO
answers with torch's dump (NCCL's own recorder where the groups are NCCL's) in
flight_record_path: which collective of which group
every rank last enqueued, started and completed. It needs the GIL, which a rank blocked in a
collective or a device synchronisation has released; a rank that holds it, or is stopped,
does not answer -- the stack dump (faulthandler, from a signal handler) still does. NCCL's own
dump on its watchdog's timeout (TORCH_NCCL_DUMP_ON_TIMEOUT) needs no thread of ours.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch._C._distributed_c10d as c10d

from lazarus.core.contract import flight_pipe_path, flight_record_path
from lazarus.trainer.collprogress import uses_nccl

log = logging.getLogger(__name__)


def recorder_on(environ=os.environ) -> bool:
    """Whether torch records collectives in this process (it reads the size at each process
    group's creation)."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = environ.get(name)
        if value is not None:
            try:
                return int(value) > 0
            except ValueError:
                return False
    return False


def serve_flight_record(dump_dir: str | Path) -> Path | None:
    """Answer the agent's requests for this process's flight record; returns the FIFO, or None
    when the recorder is off or the FIFO cannot be made (the stacks are still dumped)."""
    if not recorder_on():
        return None
    pipe = flight_pipe_path(dump_dir, os.getpid())
    try:
        pipe.unlink(missing_ok=True)  # a pid reused since an earlier worker's
        os.mkfifo(pipe, 0o600)
    except OSError as e:
        log.warning("flight record requests not served: %s", e)
        return None
    out = flight_record_path(dump_dir, os.getpid())
    threading.Thread(target=_serve, args=(pipe, out), name="lazarus-flight-record",
                     daemon=True).start()
    return pipe


def _serve(pipe: Path, out: Path) -> None:
    while True:
        try:
            fd = os.open(pipe, os.O_RDONLY)  # blocks, without the GIL, until the agent writes
        except OSError:
            return  # the FIFO is gone: nobody can ask any more (EINTR is retried by Python)
        try:
            asked = os.read(fd, 64)
        finally:
            os.close(fd)
        if asked:
            write_record(out)


def _dumper():
    """torch's dump of the recorder this process's groups write into: ProcessGroupNCCL keeps
    a recorder of its own, which the generic dump does not show (it would list none of the
    training's collectives on GPUs)."""
    nccl = getattr(c10d, "_dump_nccl_trace_json", None)  # CUDA builds only
    if nccl is not None and uses_nccl():
        return nccl
    return getattr(c10d, "_dump_fr_trace_json", None)  # torch >= 2.8


def write_record(out: Path) -> None:
    """This process's flight record, JSON, into `out` (whole or not at all)."""
    dump = _dumper()
    if dump is None:
        log.warning("flight record not written: this torch has no flight recorder dump")
        return
    try:
        data = dump(includeCollectives=True, onlyActive=False)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:
        log.warning("flight record not written: %s", e)
