"""A simulated GPU backend for machines without a GPU, driven by a fault script.

The script is a JSON array in a file (the agent gets its path from --gpu-faults or env
LAZARUS_GPU_FAULTS). The backend re-reads it whenever it changes, so `lazarus chaos gpu-xid`
injects a fault into a running agent by appending an entry (`add_fault`):

    [{"gpu": 0, "fault": "xid", "code": 79, "at_s": 0},
     {"gpu": 1, "fault": "ecc-sbe-rising", "count": 5, "at_s": 10}]

`at_s` counts from the moment the backend first read that entry. Persistent faults last as
long as their entry is in the file (delete it and the GPU heals); an Xid fires once.

    fault               effect (from at_s on)                          params (default)
    xid                 one Xid event                                  code (79)
    ecc-dbe             uncorrectable ECC count, volatile + aggregate  count (1)
    ecc-sbe-rising      corrected ECC count grows on every sample      count (10)
    thermal             temperature at slowdown, thermal slowdown bit  temp_c (slowdown + 2)
    power-brake         power brake slowdown bit
    row-remap-pending   a row remap waits for a reset
    pcie-degraded       link width halved
    nvlink-errors       NVLink error counters grow on every sample     count (1000)
    lost                every query answers "GPU is lost"
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pynvml

from lazarus.agent.gpu_sample import GpuSample
from lazarus.core.errors import UserError

log = logging.getLogger(__name__)

FAULTS_ENV = "LAZARUS_GPU_FAULTS"

FAULT_PARAMS = {
    "xid": {"code": 79},
    "ecc-dbe": {"count": 1},
    "ecc-sbe-rising": {"count": 10},
    "thermal": {"temp_c": None},
    "power-brake": {},
    "row-remap-pending": {},
    "pcie-degraded": {},
    "nvlink-errors": {"count": 1000},
    "lost": {},
}

# A healthy H100-class GPU at work.
_SLOWDOWN_C, _SHUTDOWN_C = 90, 95
_HEALTHY = GpuSample(
    index=0, ecc_sbe_volatile=0, ecc_dbe_volatile=0, ecc_sbe_aggregate=0, ecc_dbe_aggregate=0,
    remapped_rows=0, remap_pending=False, remap_failure=False, temperature_c=55,
    slowdown_c=_SLOWDOWN_C, shutdown_c=_SHUTDOWN_C, clock_event_reasons=0, power_w=500.0,
    power_limit_w=700.0, default_power_limit_w=700.0, utilization=95, pcie_gen=5,
    pcie_gen_max=5, pcie_width=16, pcie_width_max=16, nvlink_active=18, nvlink_errors=0)


@dataclass(frozen=True, slots=True)
class Fault:
    gpu: int
    fault: str
    at_s: float = 0.0
    params: dict = field(default_factory=dict)


def parse_faults(text: str, *, gpus: int | None = None) -> list[Fault]:
    """The faults of a script; UserError naming the first bad entry."""
    try:
        doc = json.loads(text) if text.strip() else []
    except ValueError as e:
        raise UserError(f"GPU fault script: not JSON ({e})") from None
    if not isinstance(doc, list):
        raise UserError("GPU fault script: expected a JSON array of fault objects")
    faults = []
    for i, entry in enumerate(doc):
        if not isinstance(entry, dict):
            raise UserError(f"GPU fault script entry {i}: expected an object")
        kind = entry.get("fault")
        if kind not in FAULT_PARAMS:
            raise UserError(f"GPU fault script entry {i}: unknown fault {kind!r} "
                            f"(known: {', '.join(FAULT_PARAMS)})")
        gpu, at_s = entry.get("gpu", 0), entry.get("at_s", 0)
        if not isinstance(gpu, int) or gpu < 0 or (gpus is not None and gpu >= gpus):
            raise UserError(f"GPU fault script entry {i}: no GPU {gpu!r}")
        if not isinstance(at_s, (int, float)) or at_s < 0:
            raise UserError(f"GPU fault script entry {i}: at_s must be a number >= 0")
        unknown = set(entry) - {"gpu", "fault", "at_s"} - set(FAULT_PARAMS[kind])
        if unknown:
            raise UserError(f"GPU fault script entry {i}: {kind} takes no {sorted(unknown)}")
        params = {**FAULT_PARAMS[kind], **{k: entry[k] for k in FAULT_PARAMS[kind] if k in entry}}
        faults.append(Fault(gpu=gpu, fault=kind, at_s=float(at_s), params=params))
    return faults


def add_fault(path: Path, entry: dict) -> None:
    """Append one fault to a script, atomically (the agent never reads half a file)."""
    path = Path(path)
    text = path.read_text() if path.exists() else "[]"
    entries = json.loads(text) if text.strip() else []
    entries.append(entry)
    parse_faults(json.dumps(entries))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, path)


class SimulatedBackend:
    """`gpus` healthy GPUs plus whatever the script at `script` says. `clock` is injectable
    so tests step time instead of sleeping."""

    name = "sim"

    def __init__(self, *, gpus: int, script: Path | None = None, detail: str = "simulated",
                 clock: Callable[[], float] = time.monotonic):
        self.gpus = gpus
        self.script = Path(script) if script is not None else None
        self.detail = detail + (f", fault script {self.script}" if self.script else "")
        self._clock = clock
        self._stamp: tuple[int, int, int] | None = None
        self._faults: list[tuple[str, Fault]] = []     # (identity, fault)
        self._first_seen: dict[str, float] = {}
        self._fired: set[str] = set()
        self._sbe = [0] * gpus
        self._nvlink = [0] * gpus

    def _reload(self) -> None:
        if self.script is None:
            return
        try:
            st = self.script.stat()
        except FileNotFoundError:
            stamp = None
        else:
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # add_fault replaces the inode
        if stamp == self._stamp:
            return
        try:
            faults = parse_faults(self.script.read_text(), gpus=self.gpus) if stamp else []
        except (UserError, OSError) as e:
            log.warning("keeping the previous GPU faults: %s", e)
            return
        self._stamp = stamp
        # An entry's identity is its text plus its occurrence, so appending a second
        # identical Xid injects a second event while earlier entries keep their clocks.
        counts: dict[str, int] = {}
        self._faults = []
        now = self._clock()
        for f in faults:
            text = json.dumps([f.gpu, f.fault, f.at_s, f.params], sort_keys=True)
            counts[text] = counts.get(text, 0) + 1
            ident = f"{text}#{counts[text]}"
            self._first_seen.setdefault(ident, now)
            self._faults.append((ident, f))

    def _due(self, gpu: int | None = None) -> list[tuple[str, Fault]]:
        now = self._clock()
        return [(ident, f) for ident, f in self._faults
                if (gpu is None or f.gpu == gpu) and now >= self._first_seen[ident] + f.at_s]

    def device_count(self) -> int:
        return self.gpus

    def xid_events(self) -> list[tuple[int, int]]:
        self._reload()
        lost = {f.gpu for _, f in self._due() if f.fault == "lost"}
        events = []
        for ident, f in self._due():
            if f.fault == "xid" and ident not in self._fired and f.gpu not in lost:
                self._fired.add(ident)
                events.append((f.gpu, int(f.params["code"])))
        return events

    def sample(self, index: int) -> GpuSample:
        self._reload()
        due = [f for _, f in self._due(index)]
        kinds = {f.fault for f in due}
        if "lost" in kinds:
            return GpuSample(index=index, lost=True)
        for f in due:
            if f.fault == "ecc-sbe-rising":
                self._sbe[index] += int(f.params["count"])
            elif f.fault == "nvlink-errors":
                self._nvlink[index] += int(f.params["count"])
        dbe = sum(int(f.params["count"]) for f in due if f.fault == "ecc-dbe")
        reasons = 0
        temp = _HEALTHY.temperature_c
        for f in due:
            if f.fault == "thermal":
                temp = f.params["temp_c"] or _SLOWDOWN_C + 2
                reasons |= (pynvml.nvmlClocksEventReasonSwThermalSlowdown
                            | pynvml.nvmlClocksEventReasonHwThermalSlowdown)
            elif f.fault == "power-brake":
                reasons |= pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
        return dataclasses.replace(
            _HEALTHY, index=index, uuid=f"GPU-sim-{index}",
            ecc_sbe_volatile=self._sbe[index], ecc_sbe_aggregate=self._sbe[index],
            ecc_dbe_volatile=dbe, ecc_dbe_aggregate=dbe,
            remap_pending="row-remap-pending" in kinds, temperature_c=temp,
            clock_event_reasons=reasons,
            pcie_width=_HEALTHY.pcie_width // (2 if "pcie-degraded" in kinds else 1),
            nvlink_errors=self._nvlink[index])

    def close(self) -> None:
        pass
