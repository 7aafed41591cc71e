"""A node's health as the agent reports it: the GPU monitor (NVML, or the simulated backend on
a machine without GPUs) and the host monitor (checkpoint dir space and writability, memory,
mounts, I/O errors), polled at most once a period and summarised for the node status.

The daemon reads `state` per monitor: a failed GPU -> the node is cordoned and replaced now;
a degraded GPU -> a planned swap through a checkpoint; a failed host -> an alert, and the
planned swap too when the fault is the node's own (see lazarus.daemon.decide).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from lazarus.agent.gpu import HEALTHY, GpuMonitor, open_backend, worst
from lazarus.agent.host import HostConfig, HostMonitor

log = logging.getLogger(__name__)


class NodeHealth:
    """`period_s`: how often monitors are sampled; NVML queries cost about a millisecond per
    GPU, so once a second is far below 1% of any step. `host_limits`: HostConfig fields that
    replace its defaults (free-space thresholds, for a small checkpoint filesystem)."""

    def __init__(self, *, gpu_backend: str, gpus: int, fault_script: Path | None,
                 period_s: float = 1.0, host_limits: dict | None = None):
        self.gpu = GpuMonitor(open_backend(gpu_backend, gpus=gpus, fault_script=fault_script))
        self.host: HostMonitor | None = None
        self.host_limits = dict(host_limits or {})
        self.period_s = period_s
        self._next = 0.0
        self._summary: dict = {"state": HEALTHY}
        log.info("GPU monitor: %s (%s)", self.gpu.backend.name, self.gpu.backend.detail)

    @property
    def backend_name(self) -> str:
        return self.gpu.backend.name

    def watch_checkpoint_dir(self, path: str | None) -> None:
        """Start (or move) the host monitor to the run's checkpoint directory."""
        if path is None:
            self.host = None
        elif self.host is None or self.host.config.checkpoint_dir != Path(path):
            self.host = HostMonitor(HostConfig(checkpoint_dir=Path(path), **self.host_limits))

    def poll(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        if now < self._next:
            return self._summary
        self._next = now + self.period_s
        self.gpu.poll()
        gpu = self.gpu.status()
        host = self.host.poll().to_dict() if self.host is not None else None
        states = [gpu["state"]] + ([host["state"]] if host else [])
        summary = {"state": worst(states), "gpu": gpu, "host": host}
        if summary["state"] != self._summary.get("state"):
            log.warning("node health %s: gpu %s %s; host %s", summary["state"], gpu["state"],
                        [r for g in gpu["gpus"] for r in g.get("reasons", [])],
                        host["reasons"] if host else "-")
        self._summary = summary
        return summary

    def close(self) -> None:
        self.gpu.close()
