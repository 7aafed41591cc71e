"""GPU health verdicts (table), the simulated backend driven by a fault script, and NVML's
absence on a machine without a GPU."""

import dataclasses
import json

import pynvml
import pytest

from lazarus.agent.gpu import (DEGRADED, FAILED, HEALTHY, GpuMonitor, GpuSample, GpuThresholds,
                               NvmlBackend, assess, open_backend, worst)
from lazarus.agent.gpu_sim import SimulatedBackend, add_fault, parse_faults
from lazarus.core.errors import UserError

BASE = GpuSample(index=0, ecc_sbe_volatile=3, ecc_dbe_volatile=0, ecc_sbe_aggregate=40,
                 ecc_dbe_aggregate=2, remapped_rows=1, remap_pending=False,
                 remap_failure=False, temperature_c=60, slowdown_c=90, shutdown_c=95,
                 clock_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap, power_w=650.0,
                 power_limit_w=700.0, default_power_limit_w=700.0, utilization=97,
                 pcie_gen=5, pcie_gen_max=5, pcie_width=16, pcie_width_max=16,
                 nvlink_active=18, nvlink_errors=7)


def s(**changes) -> GpuSample:
    return dataclasses.replace(BASE, **changes)


# (name, previous sample, sample, expected state, words the reason must contain)
CASES = [
    ("busy healthy GPU at its power cap", BASE, BASE, HEALTHY, ""),
    ("old lifetime errors are not news", None, BASE, HEALTHY, ""),
    ("critical Xid 79", BASE, s(xids=(79,)), FAILED, "Xid 79"),
    ("Xid 48 double-bit", BASE, s(xids=(48,)), FAILED, "double-bit"),
    ("application Xid 13 is the program's", BASE, s(xids=(13,)), HEALTHY, ""),
    ("GPU lost", BASE, GpuSample(index=0, lost=True), FAILED, "lost"),
    ("volatile double-bit ECC", BASE, s(ecc_dbe_volatile=1), FAILED, "uncorrectable"),
    ("new aggregate double-bit ECC", BASE, s(ecc_dbe_aggregate=3), FAILED, "uncorrectable"),
    ("row remap pending", BASE, s(remap_pending=True), FAILED, "remapping pending"),
    ("row remap failure", BASE, s(remap_failure=True), FAILED, "remapping failed"),
    ("page retirement pending", BASE, s(retired_pending=True), FAILED, "retirement pending"),
    ("too many retired pages", s(retired_pages=59), s(retired_pages=60), FAILED, "60 retired"),
    ("shutdown temperature", BASE, s(temperature_c=95), FAILED, "shutdown"),
    ("NVLink error storm", BASE, s(nvlink_errors=7 + 500), FAILED, "500 NVLink"),
    ("NVLink link down", BASE, s(nvlink_active=17), FAILED, "links down"),
    ("a few NVLink errors", BASE, s(nvlink_errors=10), DEGRADED, "3 NVLink"),
    ("rising correctable ECC", BASE, s(ecc_sbe_volatile=5, ecc_sbe_aggregate=42), DEGRADED,
     "2 new correctable"),
    ("rows remapped since", BASE, s(remapped_rows=2), DEGRADED, "rows remapped"),
    ("slowdown temperature", BASE, s(temperature_c=90), DEGRADED, "slowdown threshold"),
    ("hardware thermal slowdown", BASE,
     s(clock_event_reasons=pynvml.nvmlClocksEventReasonHwThermalSlowdown), DEGRADED,
     "hardware thermal"),
    ("power brake", BASE, s(clock_event_reasons=pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown),
     DEGRADED, "power brake"),
    ("power capped by someone", BASE, s(power_limit_w=400.0), DEGRADED, "power limit 400"),
    ("PCIe width below max", BASE, s(pcie_width=8), DEGRADED, "x8 below x16"),
    ("PCIe gen below max under load", BASE, s(pcie_gen=3), DEGRADED, "gen 3 below gen 5"),
    ("PCIe gen below max when idle", BASE, s(pcie_gen=1, utilization=0), HEALTHY, ""),
    ("a query failing", BASE, s(errors=("temperature: Unknown Error",)), DEGRADED, "Unknown"),
    ("failed wins over degraded", BASE, s(xids=(79,), temperature_c=91), FAILED, "Xid 79"),
]


@pytest.mark.parametrize("name,prev,sample,state,words", CASES, ids=[c[0] for c in CASES])
def test_assess(name, prev, sample, state, words):
    verdict = assess(prev, sample, GpuThresholds())
    assert verdict.state == state, verdict.reasons
    assert bool(verdict.reasons) == (state != HEALTHY)
    assert words in " | ".join(verdict.reasons)


def test_thresholds_are_configurable():
    prev, cur = BASE, s(ecc_sbe_volatile=5, ecc_sbe_aggregate=42, nvlink_errors=57)
    assert assess(prev, cur, GpuThresholds(sbe_rise=10, nvlink_errors_failed=1000)).reasons == (
        "50 NVLink errors since the last sample",)
    assert assess(prev, cur, GpuThresholds(nvlink_errors_failed=50)).state == FAILED
    assert assess(BASE, s(xids=(79,)), GpuThresholds(critical_xids=frozenset())).state == HEALTHY


def test_worst():
    assert worst([]) == HEALTHY
    assert worst([HEALTHY, DEGRADED, HEALTHY]) == DEGRADED
    assert worst([DEGRADED, FAILED, HEALTHY]) == FAILED


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def sim(tmp_path, entries, gpus=2):
    script = tmp_path / "faults.json"
    script.write_text(json.dumps(entries))
    clock = Clock()
    return GpuMonitor(SimulatedBackend(gpus=gpus, script=script, clock=clock)), clock, script


def states(monitor):
    return [v.state for v in monitor.poll()]


def test_simulated_xid_fires_at_its_time_and_the_gpu_stays_failed(tmp_path):
    monitor, clock, _ = sim(tmp_path, [{"gpu": 1, "fault": "xid", "code": 79, "at_s": 5}])
    assert states(monitor) == [HEALTHY, HEALTHY]
    clock.t += 4.9
    assert states(monitor) == [HEALTHY, HEALTHY]
    clock.t += 0.2
    verdicts = monitor.poll()
    assert [v.state for v in verdicts] == [HEALTHY, FAILED]
    assert "Xid 79: GPU fell off the bus" in verdicts[1].reasons
    clock.t += 10  # no new event, but a GPU that threw Xid 79 does not heal
    assert states(monitor) == [HEALTHY, FAILED]
    assert monitor.state == FAILED
    # the node status names the failed GPU alone, and how many it watches
    status = monitor.status()
    assert status["count"] == 2
    assert [(g["index"], g["reasons"]) for g in status["gpus"]] == [
        (1, ["Xid 79: GPU fell off the bus"])]


def test_simulated_rising_correctable_ecc_degrades(tmp_path):
    monitor, clock, _ = sim(tmp_path, [{"gpu": 0, "fault": "ecc-sbe-rising", "count": 4}])
    assert states(monitor) == [HEALTHY, HEALTHY]  # first sample: nothing to compare with
    verdicts = monitor.poll()
    assert [v.state for v in verdicts] == [DEGRADED, HEALTHY]
    assert verdicts[0].reasons == ("4 new correctable ECC errors",)


def test_fault_injected_into_a_running_monitor(tmp_path):
    monitor, clock, script = sim(tmp_path, [])
    assert states(monitor) == [HEALTHY, HEALTHY]
    add_fault(script, {"gpu": 0, "fault": "ecc-dbe"})
    add_fault(script, {"gpu": 1, "fault": "xid", "code": 48})
    assert states(monitor) == [FAILED, FAILED]
    assert json.loads(script.read_text())[0] == {"gpu": 0, "fault": "ecc-dbe"}


def test_persistent_fault_heals_when_its_entry_is_removed(tmp_path):
    monitor, clock, script = sim(tmp_path, [{"gpu": 0, "fault": "thermal"}], gpus=1)
    verdict = monitor.poll()[0]
    assert verdict.state == DEGRADED
    assert "temperature 92 C at the slowdown threshold 90 C" in verdict.reasons
    script.write_text("[]")
    assert states(monitor) == [HEALTHY]


def test_lost_gpu_and_other_simulated_faults(tmp_path):
    monitor, clock, _ = sim(tmp_path, [
        {"gpu": 0, "fault": "lost"}, {"gpu": 1, "fault": "row-remap-pending"},
        {"gpu": 2, "fault": "pcie-degraded"}, {"gpu": 3, "fault": "power-brake"}], gpus=4)
    verdicts = monitor.poll()
    assert [v.state for v in verdicts] == [FAILED, FAILED, DEGRADED, DEGRADED]
    assert verdicts[0].reasons == ("GPU is lost (fell off the bus)",)


def test_a_second_identical_xid_is_a_second_event(tmp_path):
    backend = SimulatedBackend(gpus=1, script=tmp_path / "f.json", clock=Clock())
    add_fault(tmp_path / "f.json", {"gpu": 0, "fault": "xid", "code": 94})
    assert backend.xid_events() == [(0, 94)]
    assert backend.xid_events() == []
    add_fault(tmp_path / "f.json", {"gpu": 0, "fault": "xid", "code": 94})
    assert backend.xid_events() == [(0, 94)]


def test_a_garbled_script_keeps_the_previous_faults(tmp_path):
    monitor, clock, script = sim(tmp_path, [{"gpu": 0, "fault": "thermal"}], gpus=1)
    assert states(monitor) == [DEGRADED]
    script.write_text('[{"gpu": 0, "fault": "thermal"')
    assert states(monitor) == [DEGRADED]


@pytest.mark.parametrize("text,words", [
    ('{"gpu": 0}', "JSON array"),
    ('[{"gpu": 0, "fault": "melt"}]', "unknown fault 'melt'"),
    ('[{"gpu": 5, "fault": "xid"}]', "no GPU 5"),
    ('[{"gpu": 0, "fault": "xid", "temp_c": 3}]', "xid takes no ['temp_c']"),
    ('[{"gpu": 0, "fault": "xid", "at_s": -1}]', "at_s"),
    ("[{", "not JSON"),
])
def test_bad_fault_scripts_are_named(text, words):
    with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_faults(text, gpus=2)


def test_parse_fills_defaults():
    (fault,) = parse_faults('[{"fault": "xid"}]')
    assert (fault.gpu, fault.at_s, fault.params) == (0, 0.0, {"code": 79})


def _nvml_works() -> bool:
    try:
        NvmlBackend().close()
    except pynvml.NVMLError:
        return False
    return True


@pytest.mark.skipif(_nvml_works(), reason="this machine has a working NVML")
def test_without_nvml_auto_falls_back_to_the_simulated_backend_and_says_why():
    with pytest.raises(pynvml.NVMLError):
        NvmlBackend()
    with pytest.raises(UserError, match=r"GPU backend nvml: NVML did not initialise \(.+\)"):
        open_backend("nvml")
    backend = open_backend("auto", gpus=3)
    assert backend.name == "sim"
    assert backend.detail.startswith("simulated: NVML did not initialise (")
    monitor = GpuMonitor(backend)
    assert [v.state for v in monitor.poll()] == [HEALTHY] * 3
    assert monitor.status()["backend"] == "sim"


def test_open_backend_names():
    assert open_backend("sim", gpus=1).detail == "simulated (requested)"
    with pytest.raises(UserError, match="expected auto, nvml or sim"):
        open_backend("cuda")


class ScriptedNvml:
    """NVML's answers for one GPU, installed over pynvml's functions: this machine has no
    driver, so this is how NvmlBackend's reading of real NVML answers gets checked."""

    def __init__(self, monkeypatch, *, events=()):
        self.lost = False
        self.events = list(events)
        ecc = {(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 5,
               (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): 0,
               (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): 50,
               (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): 1}
        thresholds = {pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 90,
                      pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 95}

        def unsupported(*_):
            raise pynvml.NVMLError_NotSupported()

        def nvlink_state(_h, link):
            if link >= 4:
                raise pynvml.NVMLError_InvalidArgument()
            return int(link < 3)                      # links 0-2 active, 3 down

        def wait(_set, timeout_ms):
            assert timeout_ms == 0                     # draining must never block the agent
            if not self.events:
                raise pynvml.NVMLError_Timeout()
            return type("Event", (), {"eventType": pynvml.nvmlEventTypeXidCriticalError,
                                      "eventData": self.events.pop(0), "device": "h0"})()

        answers = {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: 1, "nvmlDeviceGetHandleByIndex": lambda i: "h0",
            "nvmlSystemGetDriverVersion": lambda: "550.54",
            "nvmlEventSetCreate": lambda: "set", "nvmlEventSetFree": lambda s: None,
            "nvmlDeviceGetSupportedEventTypes":
                lambda h: pynvml.nvmlEventTypeXidCriticalError | 1,
            "nvmlDeviceRegisterEvents": lambda h, types, s: None,
            "nvmlEventSetWait_v2": wait, "nvmlDeviceGetIndex": lambda h: 0,
            "nvmlDeviceGetUUID": lambda h: "GPU-1234",
            "nvmlDeviceGetTotalEccErrors": lambda h, err, counter: ecc[err, counter],
            "nvmlDeviceGetRetiredPages": unsupported,          # Ampere+: row remapping instead
            "nvmlDeviceGetRetiredPagesPendingStatus": unsupported,
            "nvmlDeviceGetRemappedRows": lambda h: (2, 1, 1, 0),
            "nvmlDeviceGetCurrentClocksEventReasons":
                lambda h: pynvml.nvmlClocksEventReasonSwPowerCap,
            "nvmlDeviceGetUtilizationRates": lambda h: type("U", (), {"gpu": 97})(),
            "nvmlDeviceGetNvLinkState": nvlink_state,
            "nvmlDeviceGetNvLinkErrorCounter": lambda h, link, counter: link + 1,
            "nvmlDeviceGetPowerUsage": lambda h: 650_000,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
            "nvmlDeviceGetPowerManagementDefaultLimit": lambda h: 700_000,
            "nvmlDeviceGetTemperature": lambda h, sensor: 70,
            "nvmlDeviceGetTemperatureThreshold": lambda h, which: thresholds[which],
            "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 5,
            "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 8,
            "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
        }
        for name, fn in answers.items():
            assert hasattr(pynvml, name), name
            monkeypatch.setattr(pynvml, name, self._maybe_lost(fn))

    def _maybe_lost(self, fn):
        def call(*args):
            if self.lost and args and args[0] == "h0":
                raise pynvml.NVMLError_GpuIsLost()
            return fn(*args)
        return call


def test_nvml_backend_reads_nvml_answers(monkeypatch):
    nvml = ScriptedNvml(monkeypatch, events=[79, 13])
    backend = NvmlBackend()
    assert backend.detail == "NVML, driver 550.54, 1 GPUs"
    assert backend.xid_events() == [(0, 79), (0, 13)]
    assert backend.xid_events() == []
    sample = backend.sample(0)
    assert sample == GpuSample(
        index=0, uuid="GPU-1234", ecc_sbe_volatile=5, ecc_dbe_volatile=0, ecc_sbe_aggregate=50,
        ecc_dbe_aggregate=1, retired_pages=None, retired_pending=None, remapped_rows=3,
        remap_pending=True, remap_failure=False, temperature_c=70, slowdown_c=90,
        shutdown_c=95, clock_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap,
        power_w=650.0, power_limit_w=700.0, default_power_limit_w=700.0, utilization=97,
        pcie_gen=5, pcie_gen_max=5, pcie_width=8, pcie_width_max=16, nvlink_active=3,
        nvlink_errors=4 * (1 + 2 + 3))
    monitor = GpuMonitor(backend)
    nvml.events = [79]
    (verdict,) = monitor.poll()
    assert verdict.state == FAILED
    assert verdict.reasons[:2] == ("Xid 79: GPU fell off the bus",
                                   "row remapping pending (the GPU needs a reset)")
    nvml.lost = True
    assert backend.sample(0) == GpuSample(index=0, lost=True)
    monitor.close()
