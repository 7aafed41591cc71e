"""A rank's own compute time per step, for the straggler test.

In synchronous training every rank's wall step time is the slowest rank's (the collectives
wait), so the agents compare what each rank spent working instead:

- on CPU (gloo), the process's CPU time over the step, less what its other Python threads
  burnt meanwhile: a rank blocked in a gloo collective sleeps on a socket and burns none, so
  a slow rank shows and its waiting peers do not. The threads left out are the background
  checkpoint writers (ours and DCP's) and the agent channel's: work that is not the step's,
  and more of it on rank 0 (the checkpoint's metadata and commit), which made rank 0 of a
  healthy run look 1.3x slower than its peers. torch's intra-op threads are native threads,
  not Python ones, and count;
- on CUDA, the device time of a fixed probe matmul queued on the compute stream each step
  (CUDA events, read a step later so nothing synchronizes): a GPU that is throttled, or
  slower for any reason, runs it slower. Kernel time of the step itself would include NCCL
  waits, and CPU time is no measure (the host spins in synchronizations).

Values are comparable between the ranks of one job, which is all the straggler test needs.
"""

from __future__ import annotations

import threading
import time

import torch

_PROBE_N = 1024


class ComputeClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._c0 = 0.0
        self._side0: dict[int, float] = {}
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._last: float | None = None
        if self.cuda:
            # Not randn: drawing from the global generator would shift the training's stream.
            self._probe = torch.full((_PROBE_N, _PROBE_N), 0.5, device=device,
                                     dtype=torch.bfloat16)

    def start(self) -> None:
        self._side0 = _side_cpu()
        self._c0 = time.process_time()
        if self.cuda:
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
            torch.mm(self._probe, self._probe)
            end.record()
            self._pending.append((begin, end))

    def elapsed_cpu(self) -> float:
        now = time.process_time()
        side = sum(cpu - self._side0.get(ident, 0.0) for ident, cpu in _side_cpu().items())
        return now - self._c0 - side

    def stop(self) -> float | None:
        """This step's compute seconds (CPU), or the newest finished probe's (CUDA)."""
        if not self.cuda:
            return self.elapsed_cpu()
        while self._pending and self._pending[0][1].query():
            begin, end = self._pending.pop(0)
            self._last = begin.elapsed_time(end) / 1000.0
        del self._pending[:-4]  # a probe that never finishes is not worth waiting for
        return self._last


def _side_cpu() -> dict[int, float]:
    """Thread ident -> CPU seconds so far, for this process's Python threads other than the
    main one. A thread that ends during a step leaves its share of the step counted."""
    main = threading.main_thread()
    out = {}
    for t in threading.enumerate():
        if t is main or t.ident is None:
            continue
        try:
            out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, ValueError):
            continue  # it ended between enumerate() and here
    return out
