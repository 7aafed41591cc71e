"""Whether the fused kernels can run in this process, and on which device their tensors must be."""

import functools
import importlib.util
import os

import torch

from lazarus.core.errors import UserError
from lazarus.trainer.device import device_type


def _interpreted() -> bool:
    # triton reads TRITON_INTERPRET when a kernel is defined (at @triton.jit), not when a kernel
    # runs: how our kernels were defined is the truth, whatever the variable says now. Imported
    # here, not at the top: triton is an optional dependency, and importing `launch` fixes the
    # mode for the whole process.
    from lazarus.trainer.kernels import launch

    return launch.INTERPRETED


@functools.cache  # fixed once the kernels are defined
def available() -> tuple[bool, str]:
    """(True, how they run) when the fused kernels can run here, else (False, why not)."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'lazarus[triton]')"
    if _interpreted():
        return True, "triton interpreter (TRITON_INTERPRET=1): kernels run on CPU tensors, slowly"
    if device_type() == "cuda":
        return True, "triton kernels compiled for CUDA tensors"
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"):
        return False, (
            "TRITON_INTERPRET=1 was set after the kernels were defined; set it before the "
            "process first calls lazarus.trainer.kernels"
        )
    return False, (
        "no CUDA device (set TRITON_INTERPRET=1 before the process starts to run the kernels "
        "on CPU under the triton interpreter, or turn fused kernels off)"
    )


def require(op: str, *tensors: torch.Tensor) -> None:
    """Raise UserError unless `op` can run here on these tensors."""
    ok, why = available()
    if not ok:
        raise UserError(f"fused {op} cannot run: {why}")
    device = "cpu" if _interpreted() else "cuda"
    for t in tensors:
        if t.device.type != device:
            raise UserError(f"fused {op} got a {t.device.type} tensor; here it runs on {device} ({why})")
