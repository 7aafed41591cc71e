"""The NVML backend on a real GPU against nvidia-smi's own readings of the same counters, and
the monitor's verdict on a healthy card."""

from __future__ import annotations

import subprocess


def _smi(fields: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [v.strip() for v in out.splitlines()[0].split(",")]


def test_nvml_readings_agree_with_nvidia_smi():
    from lazarus.agent.gpu import GpuMonitor, open_backend

    backend = open_backend("nvml")
    assert type(backend).__name__ == "NvmlBackend", backend
    assert backend.device_count() >= 1
    sample = backend.sample(0)
    temp, limit, name = _smi("temperature.gpu,power.limit,name")
    print(f"card: {name}\nNVML sample: {sample}\n"
          f"nvidia-smi: temperature {temp} C, enforced power limit {limit} W")
    assert not sample.lost
    assert abs(sample.temperature_c - float(temp)) <= 5
    assert abs(sample.power_limit_w - float(limit)) <= 1.0
    verdicts = GpuMonitor(backend).poll()
    print("verdicts:", [v.to_dict() for v in verdicts])
    assert verdicts[0].state == "healthy", verdicts[0].to_dict()
