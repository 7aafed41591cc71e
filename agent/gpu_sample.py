"""One reading of one GPU, as both backends (NVML and the simulated one) produce it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One reading of one GPU. None = the GPU does not support the query (e.g. no ECC, no
    NVLink, row remapping on pre-Ampere parts)."""
    index: int
    uuid: str = ""
    lost: bool = False                      # NVML_ERROR_GPU_IS_LOST: off the bus
    xids: tuple[int, ...] = ()              # Xid events since the previous sample
    ecc_sbe_volatile: int | None = None     # corrected errors since the driver loaded
    ecc_dbe_volatile: int | None = None     # uncorrected errors since the driver loaded
    ecc_sbe_aggregate: int | None = None    # lifetime counts
    ecc_dbe_aggregate: int | None = None
    retired_pages: int | None = None        # pre-Ampere page retirement, both causes
    retired_pending: bool | None = None
    remapped_rows: int | None = None        # Ampere+ row remapping, both causes
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    temperature_c: int | None = None
    slowdown_c: int | None = None
    shutdown_c: int | None = None
    clock_event_reasons: int | None = None  # nvmlClocksEventReason* bit mask
    power_w: float | None = None
    power_limit_w: float | None = None      # enforced limit
    default_power_limit_w: float | None = None
    utilization: int | None = None          # percent of time a kernel ran
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlink_active: int | None = None        # active links
    nvlink_errors: int | None = None        # replay + recovery + CRC errors over active links
    errors: tuple[str, ...] = ()            # queries that failed for other reasons
