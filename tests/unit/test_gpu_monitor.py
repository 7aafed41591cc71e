"""GPU health verdicts (table), the simulated backend driven by a fault script, and NVML's
absence on a machine without a GPU."""

import dataclasses
import json
import logging

import pynvml
import pytest

from lazarus.agent.gpu import (DEGRADED, FAILED, HEALTHY, RECOVERY_ACTION_FIELD,
                               RECOVERY_ACTIONS, RECOVERY_NONE, GpuMonitor, GpuSample,
                               GpuThresholds, NvmlBackend, assess, open_backend, worst)
from lazarus.agent.gpu_sim import SimulatedBackend, add_fault, parse_faults
from lazarus.core.errors import UserError


@pytest.fixture(autouse=True)
def _gpu_warnings_heard(caplog):
    # The simulated fleet quiets lazarus.agent.gpu to ERROR for the whole process (thousands
    # of agents' lines), and a test that ran it earlier leaves it so: these tests read its
    # warnings.
    caplog.set_level(logging.WARNING, logger="lazarus.agent.gpu")

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
    ("Xid 119 GSP RPC timeout", BASE, s(xids=(119,)), FAILED,
     "Xid 119: GSP RPC timeout (the GPU is unusable until it is reset)"),
    ("Xid 120 GSP error", BASE, s(xids=(120,)), FAILED, "Xid 120: GSP error"),
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
    ("an admin's power cap is no fault", BASE, s(power_limit_w=400.0), HEALTHY, ""),
    ("capped and held at the cap", BASE,
     s(power_limit_w=400.0, clock_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap),
     HEALTHY, ""),
    ("hardware slowdown", BASE, s(clock_event_reasons=pynvml.nvmlClocksEventReasonHwSlowdown),
     DEGRADED, "clocks slowed: hardware slowdown"),
    ("thermal slowdown under a power cap", BASE,
     s(power_limit_w=400.0, clock_event_reasons=pynvml.nvmlClocksEventReasonSwPowerCap
       | pynvml.nvmlClocksEventReasonSwThermalSlowdown), DEGRADED,
     "clocks slowed: software thermal slowdown"),
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


A = pynvml  # the recovery actions' names are long
RECOVERY = [
    # (Xids in the sample, the driver's recovery action, state, the reasons)
    ((), None, HEALTHY, ()),
    ((), A.NVML_GPU_RECOVERY_ACTION_NONE, HEALTHY, ()),
    ((154,), A.NVML_GPU_RECOVERY_ACTION_NONE, HEALTHY, ()),   # changed back: recovered
    ((154,), A.NVML_GPU_RECOVERY_ACTION_GPU_RESET, FAILED,
     ("Xid 154: the driver's recovery action: reset the GPU",)),
    ((154,), A.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, FAILED,
     ("Xid 154: the driver's recovery action: reboot the node",)),
    ((154,), A.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P, FAILED,
     ("Xid 154: the driver's recovery action: drain peer-to-peer traffic",)),
    ((154,), A.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET, DEGRADED,
     ("Xid 154: the driver's recovery action: drain, then reset the GPU",)),
    ((154,), None, FAILED,
     ("Xid 154: the driver asks for a recovery action that NVML does not name",)),
    ((154,), 99, FAILED, ("Xid 154: the driver's recovery action: unknown action 99",)),
    # the action stands without its event (an agent restarted after it): judged the same
    ((), A.NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT, FAILED,
     ("the driver's recovery action: reboot the system",)),
    ((), A.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET, DEGRADED,
     ("the driver's recovery action: drain, then reset the GPU",)),
]


def test_the_recovery_actions_are_nvmls():
    assert RECOVERY_ACTION_FIELD == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    assert RECOVERY_NONE == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    names = {n[len("NVML_GPU_RECOVERY_ACTION_"):]: getattr(pynvml, n) for n in dir(pynvml)
             if n.startswith("NVML_GPU_RECOVERY_ACTION_") and n != "NVML_GPU_RECOVERY_ACTION_NONE"}
    assert sorted(names.values()) == sorted(RECOVERY_ACTIONS)   # none left out
    assert [RECOVERY_ACTIONS[names[n]][0] for n in ("GPU_RESET", "NODE_REBOOT", "DRAIN_P2P",
            "DRAIN_AND_RESET", "RECOVER_IMEX_DOMAIN", "BUS_RESET", "SYSTEM_REBOOT")] == [
        FAILED, FAILED, FAILED, DEGRADED, FAILED, FAILED, FAILED]


@pytest.mark.parametrize("xids,action,state,reasons", RECOVERY)
def test_xid_154_and_the_recovery_action(xids, action, state, reasons):
    verdict = assess(BASE, s(xids=xids), GpuThresholds(), recovery_action=action)
    assert (verdict.state, verdict.reasons) == (state, reasons)


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
    driver, so this is how NvmlBackend's reading of real NVML answers gets checked.

    `raises[name] = pynvml.NVMLError(code)` makes that function fail as NVML does; an
    NVMLError among `events` is what one wait for events answers; `overrides` replace
    answers."""

    def __init__(self, monkeypatch, *, events=(), **overrides):
        self.lost = False
        self.events = list(events)
        self.raises: dict[str, pynvml.NVMLError] = {}
        self.registered = False
        self.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
        self.recovery_return = pynvml.NVML_SUCCESS
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

        def register(_h, types, _set):
            assert types == pynvml.nvmlEventTypeXidCriticalError
            self.registered = True

        def wait(_set, timeout_ms):
            assert timeout_ms == 0                     # draining must never block the agent
            if not self.events or not self.registered:
                raise pynvml.NVMLError_Timeout()
            event = self.events.pop(0)
            if isinstance(event, pynvml.NVMLError):
                raise event
            return type("Event", (), {"eventType": pynvml.nvmlEventTypeXidCriticalError,
                                      "eventData": event, "device": "h0"})()

        def field_values(_h, fields):
            assert fields == [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]
            values = (pynvml.c_nvmlFieldValue_t * 1)()
            values[0].fieldId = fields[0]
            values[0].nvmlReturn = self.recovery_return
            values[0].value.uiVal = self.recovery_action
            return values

        answers = {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: 1, "nvmlDeviceGetHandleByIndex": lambda i: "h0",
            "nvmlSystemGetDriverVersion": lambda: "550.54",
            "nvmlEventSetCreate": lambda: "set", "nvmlEventSetFree": lambda s: None,
            "nvmlDeviceGetSupportedEventTypes":
                lambda h: pynvml.nvmlEventTypeXidCriticalError | 1,
            "nvmlDeviceRegisterEvents": register,
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
            "nvmlDeviceGetFieldValues": field_values,
        }
        for name, answer in overrides.items():
            assert name in answers, name
            answers[name] = answer
        for name, fn in answers.items():
            assert hasattr(pynvml, name), name             # the installed pynvml has it
            monkeypatch.setattr(pynvml, name, self._scripted(name, fn))

    def _scripted(self, name, fn):
        def call(*args):
            if name in self.raises:
                raise self.raises[name]
            if self.lost and args and args[0] == "h0":
                raise pynvml.NVMLError_GpuIsLost()
            return fn(*args)
        return call


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


# A GPU whose every answer is healthy (ScriptedNvml's default has a row remap pending and a
# PCIe link at half width).
HEALTHY_NVML = {"nvmlDeviceGetRemappedRows": lambda h: (2, 1, 0, 0),
                "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16}


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


@pytest.mark.parametrize("where,code", [
    ("nvmlEventSetCreate", pynvml.NVML_ERROR_UNKNOWN),
    ("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_UNKNOWN),
    ("nvmlDeviceRegisterEvents", pynvml.NVML_ERROR_NO_PERMISSION),
    ("nvmlDeviceGetSupportedEventTypes", pynvml.NVML_ERROR_GPU_IS_LOST),
])
def test_xid_events_that_cannot_be_registered_keep_the_real_backend(monkeypatch, caplog,
                                                                     where, code):
    nvml = ScriptedNvml(monkeypatch, events=[79], **HEALTHY_NVML)
    nvml.raises[where] = nvml_error(code)
    backend = open_backend("auto", gpus=3)
    assert backend.name == "nvml" and backend.device_count() == 1
    assert backend.detail.startswith("NVML, driver 550.54, 1 GPUs; no Xid events (")
    assert str(nvml_error(code)) in backend.detail
    assert "NVML: no Xid events" in caplog.text
    del nvml.raises[where]                      # watched all the same, without Xid events
    monitor = GpuMonitor(backend)
    assert [v.state for v in monitor.poll()] == [HEALTHY]
    assert monitor.status()["backend"] == "nvml"
    assert "no Xid events" in monitor.status()["detail"]
    nvml.lost = True
    assert [v.state for v in monitor.poll()] == [FAILED]
    monitor.close()


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
                                  pynvml.NVML_ERROR_DRIVER_NOT_LOADED])
def test_auto_simulates_a_node_without_an_nvidia_driver(monkeypatch, code):
    nvml = ScriptedNvml(monkeypatch)
    nvml.raises["nvmlInit"] = nvml_error(code)
    backend = open_backend("auto", gpus=2)
    assert backend.name == "sim" and backend.device_count() == 2
    assert backend.detail == f"simulated: NVML did not initialise ({nvml_error(code)})"
    with pytest.raises(UserError, match=r"GPU backend nvml: NVML did not initialise \("):
        open_backend("nvml")


@pytest.mark.parametrize("where,code", [
    ("nvmlInit", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH),
    ("nvmlInit", pynvml.NVML_ERROR_NO_PERMISSION),
    ("nvmlInit", pynvml.NVML_ERROR_UNKNOWN),
    ("nvmlDeviceGetCount", pynvml.NVML_ERROR_UNKNOWN),
])
def test_a_broken_nvml_is_never_a_simulated_healthy_node(monkeypatch, where, code):
    nvml = ScriptedNvml(monkeypatch)
    nvml.raises[where] = nvml_error(code)
    with pytest.raises(UserError) as e:
        open_backend("auto", gpus=2)
    assert str(e.value) == (f"GPU backend auto: NVML is installed but did not initialise "
                            f"({nvml_error(code)}): fix the driver, or pass --gpu-backend sim")
    with pytest.raises(UserError, match=r"GPU backend nvml: NVML did not initialise \("):
        open_backend("nvml")


def test_auto_simulates_a_node_where_nvml_sees_no_gpu(monkeypatch):
    ScriptedNvml(monkeypatch, nvmlDeviceGetCount=lambda: 0)
    backend = open_backend("auto", gpus=2)
    assert (backend.name, backend.detail) == ("sim", "simulated: NVML sees no GPU")


def test_a_gpu_nvml_cannot_open_is_judged_and_opened_again(monkeypatch):
    nvml = ScriptedNvml(monkeypatch, **HEALTHY_NVML)
    nvml.raises["nvmlDeviceGetHandleByIndex"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    backend = open_backend("auto", gpus=4)
    assert backend.name == "nvml" and backend.device_count() == 1
    assert backend.detail.endswith("; no Xid events (GPU 0: GPU is lost)")
    monitor = GpuMonitor(backend)
    (verdict,) = monitor.poll()
    assert (verdict.state, verdict.reasons) == (FAILED, ("GPU is lost (fell off the bus)",))

    nvml.raises["nvmlDeviceGetHandleByIndex"] = nvml_error(pynvml.NVML_ERROR_UNKNOWN)
    assert NvmlBackend().sample(0) == GpuSample(index=0, errors=("open: Unknown Error",))
    again = GpuMonitor(NvmlBackend())
    assert [(v.state, v.reasons) for v in again.poll()] == [
        (DEGRADED, ("NVML query failed: open: Unknown Error",))]
    del nvml.raises["nvmlDeviceGetHandleByIndex"]   # opened at the next sample
    assert [v.state for v in again.poll()] == [HEALTHY]


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_TIMEOUT, pynvml.NVML_ERROR_GPU_IS_LOST,
                                  pynvml.NVML_ERROR_UNKNOWN])
def test_an_error_reading_events_is_no_event(monkeypatch, caplog, code):
    nvml = ScriptedNvml(monkeypatch, events=[79, nvml_error(code), 48, nvml_error(code)])
    backend = NvmlBackend()
    assert backend.xid_events() == [(0, 79)]
    assert backend.xid_events() == [(0, 48)]
    assert backend.xid_events() == []
    warned = [r.message for r in caplog.records if "reading Xid events failed" in r.message]
    # said once while it lasts, never for NVML's "no event"
    assert warned == ([] if code == pynvml.NVML_ERROR_TIMEOUT else
                      [f"NVML: reading Xid events failed ({nvml_error(code)}); the GPUs' "
                       f"samples still judge them"])
    nvml.events = [94]
    nvml.raises["nvmlDeviceGetIndex"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert backend.xid_events() == []               # its GPU's sample says it is lost
    assert "Xid 94 from a GPU NVML cannot name (GPU is lost)" in caplog.text


@pytest.mark.parametrize("where", ["nvmlDeviceGetNvLinkState",
                                   "nvmlDeviceGetNvLinkErrorCounter"])
@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_TIMEOUT,
                                  pynvml.NVML_ERROR_NO_PERMISSION])
def test_an_nvlink_query_error_is_no_data_not_a_link_down(monkeypatch, where, code):
    nvml = ScriptedNvml(monkeypatch, **HEALTHY_NVML)
    monitor = GpuMonitor(NvmlBackend())
    assert [v.state for v in monitor.poll()] == [HEALTHY]
    nvml.raises[where] = nvml_error(code)
    sample = monitor.backend.sample(0)
    assert (sample.nvlink_active, sample.nvlink_errors) == (None, None)
    assert sample.errors == (f"nvlink: {nvml_error(code)}",)
    (verdict,) = monitor.poll()
    assert (verdict.state, verdict.reasons) == (
        DEGRADED, (f"NVML query failed: nvlink: {nvml_error(code)}",))
    del nvml.raises[where]
    assert [v.state for v in monitor.poll()] == [HEALTHY]


def test_a_gpu_lost_under_an_nvlink_query_is_failed(monkeypatch):
    nvml = ScriptedNvml(monkeypatch, **HEALTHY_NVML)
    nvml.raises["nvmlDeviceGetNvLinkErrorCounter"] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    (verdict,) = GpuMonitor(NvmlBackend()).poll()
    assert (verdict.state, verdict.reasons) == (FAILED, ("GPU is lost (fell off the bus)",))


def test_xid_154_is_judged_by_the_recovery_action_nvml_reads(monkeypatch):
    nvml = ScriptedNvml(monkeypatch, **HEALTHY_NVML)
    monitor = GpuMonitor(NvmlBackend())
    assert [v.state for v in monitor.poll()] == [HEALTHY]
    nvml.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET
    assert [(v.state, v.reasons) for v in monitor.poll()] == [
        (DEGRADED, ("the driver's recovery action: drain, then reset the GPU",))]
    nvml.events, nvml.recovery_action = [154], pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    assert [(v.state, v.reasons) for v in monitor.poll()] == [
        (FAILED, ("Xid 154: the driver's recovery action: reboot the node",))]

    # a driver that announces the change but whose NVML does not offer the field
    nvml.recovery_return = pynvml.NVML_ERROR_NOT_SUPPORTED
    backend = NvmlBackend()
    assert backend.recovery_action(0) is None
    nvml.events = [154]
    assert [(v.state, v.reasons) for v in GpuMonitor(backend).poll()] == [
        (FAILED, ("Xid 154: the driver asks for a recovery action that NVML does not name",))]
    nvml.raises["nvmlDeviceGetFieldValues"] = nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    assert backend.recovery_action(0) is None


def test_a_power_capped_gpu_at_work_passes_preflight(monkeypatch):
    from lazarus.agent import preflight as P

    ScriptedNvml(monkeypatch, **HEALTHY_NVML,
                 nvmlDeviceGetEnforcedPowerLimit=lambda h: 400_000,
                 nvmlDeviceGetPowerUsage=lambda h: 399_000)
    monitor = GpuMonitor(NvmlBackend())
    verdicts = monitor.poll()
    assert monitor.backend.sample(0).clock_event_reasons == (
        pynvml.nvmlClocksEventReasonSwPowerCap)
    assert P.gpus(verdicts, 1, "nvml") == (True, "1 GPU healthy (nvml)")
