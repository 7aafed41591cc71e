"""What a step cost the accelerator: its MFU and its peak memory, for the step's metrics line.

On CPU there is neither a peak figure nor an allocator to ask, and the line carries neither.
The peak memory is this rank's (rank 0 writes the metrics): ranks of one mesh hold the same
shapes, so it stands for all of them.
"""

from __future__ import annotations

import torch

from lazarus.core.flops import flops_per_token, mfu, peak_tflops
from lazarus.core.modelconfig import ModelConfig


class DeviceStats:
    def __init__(self, device: torch.device, model: ModelConfig, *, seq_len: int, ranks: int,
                 peak: float | None = None):
        self.cuda = device.type == "cuda"
        self.ranks = ranks
        self.per_token = flops_per_token(model, seq_len)
        self.peak = peak
        if self.cuda:
            self.device = device
            if self.peak is None:
                self.peak = peak_tflops(torch.cuda.get_device_name(device))
            torch.cuda.reset_peak_memory_stats(device)

    def fields(self, *, tokens: int, step_time_s: float) -> dict:
        """{"mfu", "peak_mem_gib"} of the step just done (empty on CPU), and a new peak."""
        if not self.cuda:
            return {}
        row = {"peak_mem_gib": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 3)}
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.peak is not None and step_time_s > 0:
            row["mfu"] = round(mfu(tokens / step_time_s / self.ranks, self.per_token, self.peak), 4)
        return row

    @staticmethod
    def line(row: dict) -> str:
        parts = []
        if "mfu" in row:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        if "peak_mem_gib" in row:
            parts.append(f"peak mem {row['peak_mem_gib']:.1f} GiB")
        return "".join(f" | {p}" for p in parts)


def make_deterministic() -> None:
    """Deterministic kernels, so that a resumed run repeats the uninterrupted one bit for bit
    on CUDA too. cuBLAS reads its workspace setting when its handle is made: the worker sets
    CUBLAS_WORKSPACE_CONFIG before any CUDA work (lazarus.trainer.worker)."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    # TF32 products depend on nothing random, but keep them off: their results differ
    # between cards, and a resume may land on another one.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
