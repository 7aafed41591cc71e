"""GPU health: samples from NVML (or a simulated backend), and a pure verdict per GPU.

The monitor is split so the policy can be tested without a GPU:

    backend.sample(i) -> GpuSample        what NVML says now (NvmlBackend: real pynvml calls)
    backend.xid_events() -> [(i, xid)]    Xid errors since the last call (an NVML event set)
    assess(previous, sample, thresholds)  -> GpuVerdict: healthy / degraded / failed + reasons

`failed` means the node must be cordoned and swapped now (docs/architecture.md, "Failure
classes"): a critical Xid, an uncorrectable ECC error, a pending or failed row remap, a GPU off
the bus, NVLink errors at a rate that breaks collectives, a driver asking for a reset or a
reboot (its recovery action). `degraded` means it still works but is heading there or running
slow: correctable ECC errors rising, thermal or hardware slowdown, a PCIe link below its
maximum, a driver asking for a drain; the daemon answers with a checkpoint and a planned swap.
A power limit below the default is neither: an admin's cap, at which a busy GPU runs all day.

An NVML error is a verdict or "no data", never an exception out of the monitor: a lost GPU is
a failed GPU, another query's error a degraded one (it says which query), and an event set that
cannot be read means no Xid events this poll.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pynvml

from lazarus.agent.gpu_sample import GpuSample
from lazarus.agent.gpu_sim import SimulatedBackend
from lazarus.core.errors import UserError
from lazarus.core.records import H_DEGRADED, H_FAILED, H_HEALTHY

log = logging.getLogger(__name__)

HEALTHY, DEGRADED, FAILED = H_HEALTHY, H_DEGRADED, H_FAILED
_SEVERITY = {HEALTHY: 0, DEGRADED: 1, FAILED: 2}


def worst(states: Iterable[str]) -> str:
    """The most severe of several health states (healthy when there are none)."""
    return max(states, key=_SEVERITY.__getitem__, default=HEALTHY)


# Xids after which NVIDIA's guidance is to drain the GPU (reset or replace it). Application
# faults (13, 31, 43: illegal address, MMU fault, ...) are not here: they follow the program,
# not the hardware, and the worker crash handling covers them.
XID_MEANINGS = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remap recorded (reset needed)",
    64: "ECC page retirement or row remap failed",
    74: "NVLink error",
    79: "GPU fell off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout (the GPU is unusable until it is reset)",
    120: "GSP error (the GPU is unusable until it is reset)",
}
CRITICAL_XIDS = frozenset(XID_MEANINGS)

# Xid 154: the driver changed the GPU's recovery action. Its severity is that action's, read
# from NVML's field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and judged on every poll, event or not.
# By number, as nvml.h has them: nvidia-ml-py releases before 13 lack some of the names, and
# the agent must import with those too.
XID_RECOVERY_ACTION = 154
RECOVERY_ACTION_FIELD = 230
RECOVERY_NONE = 0
RECOVERY_ACTIONS = {                                   # NVML_GPU_RECOVERY_ACTION_*
    1: (FAILED, "reset the GPU"),                      # GPU_RESET
    2: (FAILED, "reboot the node"),                    # NODE_REBOOT
    3: (FAILED, "drain peer-to-peer traffic"),         # DRAIN_P2P: NCCL's processes do it
    4: (DEGRADED, "drain, then reset the GPU"),        # DRAIN_AND_RESET: it still runs its work
    5: (FAILED, "recover the IMEX domain"),            # RECOVER_IMEX_DOMAIN
    6: (FAILED, "reset the GPU's PCIe bus"),           # BUS_RESET
    7: (FAILED, "reboot the system"),                  # SYSTEM_REBOOT
}

# Clock event reasons that mean the GPU is slowed by heat or power hardware. Software power
# capping (SwPowerCap) is left out: a busy training GPU sits at its power cap all the time.
SLOWDOWN_REASONS = {
    pynvml.nvmlClocksEventReasonHwSlowdown: "hardware slowdown",
    pynvml.nvmlClocksEventReasonSwThermalSlowdown: "software thermal slowdown",
    pynvml.nvmlClocksEventReasonHwThermalSlowdown: "hardware thermal slowdown",
    pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "power brake slowdown",
}


@dataclass(kw_only=True, slots=True)
class GpuThresholds:
    critical_xids: frozenset[int] = CRITICAL_XIDS
    # New corrected ECC errors between two samples that make a GPU degraded.
    sbe_rise: int = 1
    # Retired pages at which NVIDIA considers the board for replacement.
    retired_pages_max: int = 60
    # Degraded within this many degrees of the slowdown threshold; failed at shutdown.
    slowdown_margin_c: int = 0
    # A link below its maximum generation only counts when the GPU is busy: idle GPUs drop
    # their link speed to save power.
    pcie_busy_utilization: int = 50
    # NVLink errors between two samples: degraded from the first, failed from this many.
    nvlink_errors_failed: int = 100


@dataclass(frozen=True, slots=True)
class GpuVerdict:
    index: int
    state: str
    reasons: tuple[str, ...] = ()
    uuid: str = ""

    def to_dict(self) -> dict:
        return {"index": self.index, "uuid": self.uuid, "state": self.state,
                "reasons": list(self.reasons)}


def _rise(prev: GpuSample | None, cur: GpuSample, name: str) -> int:
    now = getattr(cur, name)
    before = getattr(prev, name) if prev is not None else None
    if now is None or before is None:
        return 0
    return max(0, now - before)


def _recovery(action: int | None, announced: bool) -> tuple[str, str] | None:
    """The verdict on the driver's recovery action (None: nothing to do, or not known);
    `announced`: an Xid 154 came with the sample."""
    xid = f"Xid {XID_RECOVERY_ACTION}: " if announced else ""
    if action is None:
        # the driver said the GPU needs recovering, NVML does not say how: assume the worst
        return (FAILED, f"{xid}the driver asks for a recovery action that NVML does not name"
                ) if announced else None
    if action == RECOVERY_NONE:
        return None
    state, what = RECOVERY_ACTIONS.get(action, (FAILED, f"unknown action {action}"))
    return state, f"{xid}the driver's recovery action: {what}"


def assess(previous: GpuSample | None, sample: GpuSample, thresholds: GpuThresholds, *,
           recovery_action: int | None = None) -> GpuVerdict:
    """The health of one GPU from its sample and the one before it (None on the first).
    `recovery_action`: the driver's (RECOVERY_ACTIONS) for it, None when unknown."""
    failed: list[str] = []
    degraded: list[str] = []
    s, t = sample, thresholds
    if s.lost:
        failed.append("GPU is lost (fell off the bus)")
    for xid in s.xids:
        if xid in t.critical_xids:
            failed.append(f"Xid {xid}: {XID_MEANINGS.get(xid, 'critical error')}")
    if recovery := _recovery(recovery_action, XID_RECOVERY_ACTION in s.xids):
        (failed if recovery[0] == FAILED else degraded).append(recovery[1])
    if s.ecc_dbe_volatile:
        failed.append(f"{s.ecc_dbe_volatile} uncorrectable ECC errors since the driver loaded")
    elif rise := _rise(previous, s, "ecc_dbe_aggregate"):
        failed.append(f"{rise} new uncorrectable ECC errors")
    if s.remap_pending:
        failed.append("row remapping pending (the GPU needs a reset)")
    if s.remap_failure:
        failed.append("row remapping failed (no spare rows left)")
    if s.retired_pending:
        failed.append("page retirement pending (the GPU needs a reset)")
    if s.retired_pages is not None and s.retired_pages >= t.retired_pages_max:
        failed.append(f"{s.retired_pages} retired pages (limit {t.retired_pages_max})")
    if s.temperature_c is not None and s.shutdown_c and s.temperature_c >= s.shutdown_c:
        failed.append(f"temperature {s.temperature_c} C at the shutdown threshold "
                      f"{s.shutdown_c} C")
    nvlink_rise = _rise(previous, s, "nvlink_errors")
    if nvlink_rise >= t.nvlink_errors_failed:
        failed.append(f"{nvlink_rise} NVLink errors since the last sample")
    elif nvlink_rise:
        degraded.append(f"{nvlink_rise} NVLink errors since the last sample")
    if (previous is not None and previous.nvlink_active is not None
            and s.nvlink_active is not None and s.nvlink_active < previous.nvlink_active):
        failed.append(f"NVLink links down: {s.nvlink_active} active, "
                      f"{previous.nvlink_active} before")

    sbe_rise = max(_rise(previous, s, "ecc_sbe_volatile"), _rise(previous, s, "ecc_sbe_aggregate"))
    if sbe_rise >= t.sbe_rise:
        degraded.append(f"{sbe_rise} new correctable ECC errors")
    if rise := _rise(previous, s, "retired_pages"):
        degraded.append(f"{rise} pages retired since the last sample")
    if rise := _rise(previous, s, "remapped_rows"):
        degraded.append(f"{rise} rows remapped since the last sample")
    if (s.temperature_c is not None and s.slowdown_c
            and s.slowdown_c - t.slowdown_margin_c <= s.temperature_c < (s.shutdown_c or 1 << 30)):
        degraded.append(f"temperature {s.temperature_c} C at the slowdown threshold "
                        f"{s.slowdown_c} C")
    if s.clock_event_reasons:
        slow = [name for bit, name in SLOWDOWN_REASONS.items() if s.clock_event_reasons & bit]
        if slow:
            degraded.append("clocks slowed: " + ", ".join(slow))
    if s.pcie_width and s.pcie_width_max and s.pcie_width < s.pcie_width_max:
        degraded.append(f"PCIe link x{s.pcie_width} below x{s.pcie_width_max}")
    if (s.pcie_gen and s.pcie_gen_max and s.pcie_gen < s.pcie_gen_max
            and (s.utilization or 0) >= t.pcie_busy_utilization):
        degraded.append(f"PCIe link gen {s.pcie_gen} below gen {s.pcie_gen_max} under load")
    degraded.extend(f"NVML query failed: {e}" for e in s.errors)

    state = FAILED if failed else DEGRADED if degraded else HEALTHY
    return GpuVerdict(index=s.index, state=state, reasons=tuple(failed + degraded), uuid=s.uuid)


class GpuBackend(Protocol):
    name: str       # "nvml" or "sim": the agent's status shows it
    detail: str     # one line: driver version, or why the simulated backend runs

    def device_count(self) -> int: ...
    def sample(self, index: int) -> GpuSample: ...
    def xid_events(self) -> list[tuple[int, int]]: ...
    def close(self) -> None: ...


# nvmlInit's errors that mean "no NVIDIA GPU here". Any other (a driver/library mismatch after an
# upgrade, no permission, ...) is a GPU node whose NVML is broken: never simulated as healthy.
_NO_NVML = (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded)
# Queries a GPU or driver may not offer: no data, and nothing wrong with the GPU.
_UNSUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
_XID = pynvml.nvmlEventTypeXidCriticalError


class NvmlBackend:
    """Real NVML. The constructor raises pynvml.NVMLError when NVML does not initialise (no
    driver, no library, a broken driver) or cannot count its GPUs: `open_backend` turns that
    into a fallback or a UserError. Past that, what fails is reported, not raised: a GPU NVML
    cannot open is judged on every sample (lost, or an error that degrades it), and Xid events
    that cannot be registered are missing from `detail` and the log, not the backend."""

    name = "nvml"

    def __init__(self):
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except pynvml.NVMLError:
            pynvml.nvmlShutdown()
            raise
        self._handles: list = [self._open(i) for i in range(count)]
        self._events, missing = self._register_xid_events()
        self._wait_error = ""
        self.detail = f"NVML, driver {driver}, {count} GPUs"
        if missing:
            self.detail += f"; no Xid events ({missing})"
            log.warning("NVML: no Xid events (%s); the GPUs' other queries are watched",
                        missing)

    @staticmethod
    def _open(index: int):
        """The GPU's handle, or the NVMLError that refused it (tried again at each sample)."""
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError as e:
            return e

    def _handle(self, index: int):
        handle = self._handles[index]
        if isinstance(handle, pynvml.NVMLError):
            handle = self._handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
        return handle

    def _register_xid_events(self) -> tuple[object | None, str]:
        """An event set with the Xid errors of every GPU that offers them, and what could not
        be registered ("" when nothing)."""
        try:
            events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            return None, f"event set: {e}"
        missing = []
        for index, handle in enumerate(self._handles):
            if isinstance(handle, pynvml.NVMLError):
                missing.append(f"GPU {index}: {handle}")
                continue
            try:
                if pynvml.nvmlDeviceGetSupportedEventTypes(handle) & _XID:
                    pynvml.nvmlDeviceRegisterEvents(handle, _XID, events)
            except pynvml.NVMLError_NotSupported:
                pass  # a GPU without Xid events (a vGPU, a GeForce): its other queries tell
            except pynvml.NVMLError as e:
                missing.append(f"GPU {index}: {e}")
        return events, "; ".join(missing)

    def device_count(self) -> int:
        return len(self._handles)

    def xid_events(self) -> list[tuple[int, int]]:
        """Drain the event set without blocking: (gpu index, Xid) pairs. Any NVML error ends
        the drain: TIMEOUT is NVML's "no event", and after another (a lost GPU, UNKNOWN) the
        samples judge the GPUs; said in the log when it changes."""
        out: list[tuple[int, int]] = []
        while self._events is not None:
            try:
                data = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError_Timeout:
                self._wait_error = ""
                break
            except pynvml.NVMLError as e:
                if str(e) != self._wait_error:
                    log.warning("NVML: reading Xid events failed (%s); the GPUs' samples "
                                "still judge them", e)
                self._wait_error = str(e)
                break
            if data.eventType & _XID:
                try:
                    out.append((pynvml.nvmlDeviceGetIndex(data.device), int(data.eventData)))
                except pynvml.NVMLError as e:  # a GPU gone since: its sample says it is lost
                    log.warning("NVML: Xid %d from a GPU NVML cannot name (%s)",
                                data.eventData, e)
        return out

    def recovery_action(self, index: int) -> int | None:
        """What the driver says the GPU needs (NVML_GPU_RECOVERY_ACTION_*); None when this
        driver does not say, or the GPU cannot be read (its sample says why)."""
        try:
            (field,) = pynvml.nvmlDeviceGetFieldValues(self._handle(index),
                                                       [RECOVERY_ACTION_FIELD])
        except pynvml.NVMLError:
            return None
        return field.value.uiVal if field.nvmlReturn == pynvml.NVML_SUCCESS else None

    def sample(self, index: int) -> GpuSample:
        errors: list[str] = []

        def query(what: str, fn, *args):
            try:
                return fn(handle, *args)
            except _UNSUPPORTED:
                return None
            except pynvml.NVMLError_GpuIsLost:
                raise
            except pynvml.NVMLError as e:
                errors.append(f"{what}: {e}")
                return None

        try:
            handle = self._handle(index)
        except pynvml.NVMLError_GpuIsLost:
            return GpuSample(index=index, lost=True)
        except pynvml.NVMLError as e:
            return GpuSample(index=index, errors=(f"open: {e}",))
        try:
            uuid = query("uuid", pynvml.nvmlDeviceGetUUID) or ""
            ecc = {}
            for name, err_type, counter in (
                    ("ecc_sbe_volatile", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                     pynvml.NVML_VOLATILE_ECC),
                    ("ecc_dbe_volatile", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                     pynvml.NVML_VOLATILE_ECC),
                    ("ecc_sbe_aggregate", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                     pynvml.NVML_AGGREGATE_ECC),
                    ("ecc_dbe_aggregate", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                     pynvml.NVML_AGGREGATE_ECC)):
                ecc[name] = query(name, pynvml.nvmlDeviceGetTotalEccErrors, err_type, counter)
            retired = None
            sbe_pages = query("retired pages", pynvml.nvmlDeviceGetRetiredPages,
                              pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
            dbe_pages = query("retired pages", pynvml.nvmlDeviceGetRetiredPages,
                              pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            if sbe_pages is not None and dbe_pages is not None:
                retired = len(sbe_pages) + len(dbe_pages)
            pending = query("retired pages pending",
                            pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
            remap = query("remapped rows", pynvml.nvmlDeviceGetRemappedRows)
            reasons = query("clock event reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons)
            if reasons is None:  # drivers before the rename
                reasons = query("clock throttle reasons",
                                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)
            util = query("utilization", pynvml.nvmlDeviceGetUtilizationRates)
            nvlink_active, nvlink_errors = self._nvlink(handle, errors)
            milliwatts = [query(what, fn) for what, fn in (
                ("power", pynvml.nvmlDeviceGetPowerUsage),
                ("power limit", pynvml.nvmlDeviceGetEnforcedPowerLimit),
                ("default power limit", pynvml.nvmlDeviceGetPowerManagementDefaultLimit))]
            power, limit, default_limit = (None if mw is None else mw / 1000 for mw in milliwatts)
            return GpuSample(
                index=index, uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                **ecc, retired_pages=retired,
                retired_pending=None if pending is None else pending == pynvml.NVML_FEATURE_ENABLED,
                remapped_rows=None if remap is None else remap[0] + remap[1],
                remap_pending=None if remap is None else bool(remap[2]),
                remap_failure=None if remap is None else bool(remap[3]),
                temperature_c=query("temperature", pynvml.nvmlDeviceGetTemperature,
                                    pynvml.NVML_TEMPERATURE_GPU),
                slowdown_c=query("slowdown threshold", pynvml.nvmlDeviceGetTemperatureThreshold,
                                 pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                shutdown_c=query("shutdown threshold", pynvml.nvmlDeviceGetTemperatureThreshold,
                                 pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
                clock_event_reasons=reasons, power_w=power, power_limit_w=limit,
                default_power_limit_w=default_limit,
                utilization=None if util is None else util.gpu,
                pcie_gen=query("pcie gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                pcie_gen_max=query("pcie max gen", pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                pcie_width=query("pcie width", pynvml.nvmlDeviceGetCurrPcieLinkWidth),
                pcie_width_max=query("pcie max width", pynvml.nvmlDeviceGetMaxPcieLinkWidth),
                nvlink_active=nvlink_active, nvlink_errors=nvlink_errors,
                errors=tuple(errors))
        except pynvml.NVMLError_GpuIsLost:
            return GpuSample(index=index, lost=True)

    @staticmethod
    def _nvlink(handle, errors: list[str]) -> tuple[int | None, int | None]:
        """(active links, summed error counters); (None, None) without NVLink, and when a
        query failed (said in `errors`): a link whose state was not read must not count as
        down. GPU_IS_LOST goes up to the sample."""
        active = total = 0
        seen = False
        try:
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        seen = True
                        continue
                except (*_UNSUPPORTED, pynvml.NVMLError_InvalidArgument):
                    continue  # past the GPU's last link
                seen = True
                active += 1
                for counter in (pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
                                pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                                pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                                pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA):
                    try:
                        total += pynvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)
                    except _UNSUPPORTED:
                        pass
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError as e:
            errors.append(f"nvlink: {e}")
            return None, None
        return (active, total) if seen else (None, None)

    def close(self) -> None:
        try:
            if self._events is not None:
                pynvml.nvmlEventSetFree(self._events)
        except pynvml.NVMLError as e:  # the agent is stopping: said, not raised
            log.warning("NVML: freeing the event set failed: %s", e)
        pynvml.nvmlShutdown()


def open_backend(kind: str = "auto", *, gpus: int = 1,
                 fault_script: Path | None = None) -> GpuBackend:
    """The backend the agent runs: "nvml", "sim", or "auto" (NVML when it initialises and
    sees a GPU; the simulated one with `gpus` devices when the node has no NVIDIA library or
    driver, or NVML sees no GPU). An NVML that is there but fails to initialise is a
    UserError even for "auto": a GPU node must not pass for a simulated, healthy one.
    `fault_script` drives the simulated backend (lazarus.agent.gpu_sim); real GPUs ignore it.
    The backend's `name` and `detail` say what was chosen and why.
    """

    if kind not in ("auto", "nvml", "sim"):
        raise UserError(f"GPU backend {kind!r}: expected auto, nvml or sim")
    if kind == "sim":
        return SimulatedBackend(gpus=gpus, script=fault_script, detail="simulated (requested)")
    try:
        backend = NvmlBackend()
    except pynvml.NVMLError as e:
        if kind == "nvml":
            raise UserError(f"GPU backend nvml: NVML did not initialise ({e})") from None
        if not isinstance(e, _NO_NVML):
            raise UserError(f"GPU backend auto: NVML is installed but did not initialise "
                            f"({e}): fix the driver, or pass --gpu-backend sim") from None
        return SimulatedBackend(gpus=gpus, script=fault_script,
                                detail=f"simulated: NVML did not initialise ({e})")
    if backend.device_count() == 0 and kind == "auto":
        backend.close()
        return SimulatedBackend(gpus=gpus, script=fault_script,
                                detail="simulated: NVML sees no GPU")
    if fault_script is not None:
        log.warning("GPU fault script %s ignored: real GPUs are monitored through NVML",
                    fault_script)
    return backend


@dataclass(kw_only=True, slots=True)
class _GpuState:
    previous: GpuSample | None = None
    failed_reasons: tuple[str, ...] = ()


class GpuMonitor:
    """Samples every GPU of a backend on each `poll()` and keeps the verdicts.

    A failed GPU stays failed until the monitor is rebuilt: an Xid 79 or a double-bit error
    does not heal while the process runs, and a sample that looks fine a second later must
    not un-cordon the node. Degraded is re-judged on every poll.
    """

    def __init__(self, backend: GpuBackend, thresholds: GpuThresholds | None = None):
        self.backend = backend
        self.thresholds = thresholds or GpuThresholds()
        # NVML's alone: the simulated backend has no recovery action to read
        self._recovery_action = getattr(backend, "recovery_action", lambda index: None)
        self._gpus: dict[int, _GpuState] = {}
        self.verdicts: list[GpuVerdict] = []

    def poll(self) -> list[GpuVerdict]:
        xids: dict[int, list[int]] = {}
        for index, xid in self.backend.xid_events():
            xids.setdefault(index, []).append(xid)
        verdicts = []
        for index in range(self.backend.device_count()):
            st = self._gpus.setdefault(index, _GpuState())
            sample = self.backend.sample(index)
            if index in xids:
                sample = dataclasses.replace(sample, xids=sample.xids + tuple(xids[index]))
            action = None if sample.lost else self._recovery_action(index)
            verdict = assess(st.previous, sample, self.thresholds, recovery_action=action)
            if verdict.state == FAILED and not st.failed_reasons:
                st.failed_reasons = verdict.reasons
            elif st.failed_reasons:
                verdict = GpuVerdict(index=index, state=FAILED, uuid=verdict.uuid,
                                     reasons=st.failed_reasons + tuple(
                                         r for r in verdict.reasons
                                         if r not in st.failed_reasons))
            if not sample.lost:
                st.previous = sample
            verdicts.append(verdict)
        self.verdicts = verdicts
        return verdicts

    @property
    def state(self) -> str:
        return worst(v.state for v in self.verdicts)

    def status(self) -> dict:
        """JSON-able summary for the node status: backend, overall state, how many GPUs are
        watched and the verdicts of those that are not healthy (a healthy GPU's entry would
        be most of the status's bytes at 8 GPUs, rewritten every status period)."""
        return {"backend": self.backend.name, "detail": self.backend.detail,
                "state": self.state, "count": len(self.verdicts),
                "gpus": [v.to_dict() for v in self.verdicts if v.state != HEALTHY]}

    def close(self) -> None:
        self.backend.close()
