"""Model FLOPs utilisation: the work a step's tokens cost, over what the accelerators could do.

FLOPs per token follow the usual convention (PaLM, appendix B; torchtitan counts the same):
6 x the parameters a token passes through (forward 2, backward 4; the embedding table is a
lookup, not a product) plus the attention scores and their weighting, 12 x layers x dim x
seq_len, counted over the whole square although causal attention needs half: MFU figures
published with that convention stay comparable. Activation recomputation is not counted
(that would be hardware FLOPs utilisation).

The peak is a bf16 dense figure per accelerator from the vendor's datasheet, looked up by the
name the device reports; a job can set its own (`[train] peak_tflops`).
"""

from __future__ import annotations

from lazarus.core.modelconfig import ModelConfig

# bf16 dense TFLOP/s per device, by a substring of torch.cuda.get_device_name(). Order
# matters: the first match wins, so the more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at `seq_len`."""
    dense = cfg.num_params() - cfg.vocab_size * cfg.dim  # the output projection is a product
    return 6.0 * dense + 12.0 * cfg.n_layers * cfg.dim * seq_len


def peak_tflops(device_name: str) -> float | None:
    """The bf16 dense peak of a device by its reported name; None when it is not in the
    table (set `[train] peak_tflops` then)."""
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return tflops
    return None


def mfu(tokens_per_s_per_device: float, per_token: float, peak: float) -> float:
    """The share of `peak` (TFLOP/s) a device spends on the model's own FLOPs."""
    assert peak > 0, peak
    return tokens_per_s_per_device * per_token / (peak * 1e12)
