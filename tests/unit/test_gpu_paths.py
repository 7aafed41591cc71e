"""The CUDA/NCCL paths of the trainer and the agent, checked on CPU wherever their decision can
be: which device a collective's tensor goes on, which flight recorder is dumped, how a rank
that NCCL's watchdog aborted is counted, what the hang detector is told on CUDA, and the MFU
arithmetic. tests/gpu runs the same paths on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from lazarus.core import exitcodes
from lazarus.core.contract import WorkerAssignment
from lazarus.core.errors import UserError
from lazarus.core.flops import flops_per_token, mfu, peak_tflops
from lazarus.core.modelconfig import get_model_config
from lazarus.core.trainconfig import TrainConfig
from lazarus.trainer import collprogress, flightrec, rankrun
from lazarus.trainer import snapshot as tier0
from lazarus.trainer.devstats import DeviceStats


@pytest.fixture
def nccl_default_group(monkeypatch):
    """What torch.distributed answers in a rank whose default group is NCCL's."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_a_collective_of_an_nccl_group_takes_a_cuda_tensor(nccl_default_group):
    assert collprogress.collective_device() == torch.device("cuda", 3)


def test_a_collective_of_a_gloo_group_takes_a_cpu_tensor(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collprogress.collective_device() == torch.device("cpu")


def test_the_automatic_snapshot_period_is_agreed_on_the_groups_device(monkeypatch, tmp_path):
    # On NCCL an all-reduce of a CPU tensor raises "No backend type associated with device
    # type cpu" at the first snapshot of every agent-run job: the period must ask.
    asked, reduced = [], []
    monkeypatch.setattr(tier0, "collective_device",
                        lambda: asked.append(1) or torch.device("cpu"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: reduced.append(t.device))
    snaps = tier0.Snapshotter(tmp_path, every=0, header={"rank": 0}, on_written=lambda *a: None,
                              first_step=0)
    try:
        snaps._plan(step=4, stall=0.01)
    finally:
        snaps.close()
    assert asked and reduced == [torch.device("cpu")]


def test_the_flight_record_of_an_nccl_rank_is_ncclS_own(nccl_default_group, monkeypatch, tmp_path):
    calls = []

    def dump(name):
        def f(includeCollectives, onlyActive):
            calls.append(name)
            return json.dumps({"entries": [], "from": name}).encode()
        return f

    fake = types.SimpleNamespace(_dump_fr_trace_json=dump("generic"),
                                 _dump_nccl_trace_json=dump("nccl"))
    monkeypatch.setattr(flightrec, "c10d", fake)
    out = tmp_path / "record.json"
    flightrec.write_record(out)
    assert calls == ["nccl"] and json.loads(out.read_text())["from"] == "nccl"


def test_the_flight_record_of_a_gloo_rank_is_the_generic_one(monkeypatch, tmp_path):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    fake = types.SimpleNamespace(_dump_fr_trace_json=lambda **kw: b'{"from": "generic"}',
                                 _dump_nccl_trace_json=lambda **kw: b'{"from": "nccl"}')
    monkeypatch.setattr(flightrec, "c10d", fake)
    out = tmp_path / "record.json"
    flightrec.write_record(out)
    assert json.loads(out.read_text())["from"] == "generic"


def test_ranks_ask_nccl_to_raise_rather_than_abort_unless_the_job_says(monkeypatch):
    a = WorkerAssignment(rank=0, world_size=1, local_rank=0, round=1, store_host="h",
                         store_port=1, train={})
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert rankrun.environment(a, 2)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    a.env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert rankrun.environment(a, 2)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


WATCHDOG = ("[rank1]:[E ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE) ran for 600000 "
            "milliseconds before timing out.\n"
            "terminate called after throwing an instance of 'c10::DistBackendError'\n")


def test_a_rank_that_nccls_watchdog_aborted_lost_a_peer(tmp_path):
    """A real process, printing what torch prints and dying by SIGABRT as torch's watchdog
    makes it, is counted as PEER_LOST: the daemon then waits for the root cause instead of
    blaming this healthy node."""
    from lazarus.agent.workers import Group, Workers, rank_log

    workers = Workers(nproc=2, env={}, log_dir=tmp_path / "logs", notes_dir=tmp_path,
                      park=False)
    procs = {}
    for local, (rank, text) in enumerate([(4, WATCHDOG), (5, "Segmentation fault\n")]):
        log = rank_log(workers.log_dir, 7, rank)
        log.parent.mkdir(parents=True, exist_ok=True)
        script = f"import os, sys; sys.stderr.write({text!r}); sys.stderr.flush(); os.abort()"
        with open(log, "wb") as out:
            procs[local] = subprocess.Popen([sys.executable, "-c", script], stderr=out)
    workers.group = Group(round=7, procs=procs, ranks={0: 4, 1: 5})
    for p in procs.values():
        p.wait()
    workers.poll()
    assert workers.group.exit_codes == {0: exitcodes.PEER_LOST, 1: -6}


def test_the_watchdogs_signs_need_its_signal():
    assert exitcodes.watchdog_abort(-6, WATCHDOG)
    assert exitcodes.watchdog_abort(134, WATCHDOG)
    assert not exitcodes.watchdog_abort(1, WATCHDOG)  # the script's own exit after the text
    assert not exitcodes.watchdog_abort(-6, "assertion failed\n")


class _FakeEvent:
    """A CUDA event whose passing the test decides."""
    made: list[_FakeEvent] = []

    def __init__(self):
        self.passed = False
        _FakeEvent.made.append(self)

    def record(self):
        pass

    def query(self):
        return self.passed


def test_on_cuda_the_hang_detector_sees_collectives_the_device_passed(monkeypatch):
    # NCCL enqueues: a rank whose GPU stalls keeps issuing and would look level with its
    # peers. Only what the device has passed counts.
    _FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    done = collprogress.Completed(torch.device("cuda", 0))
    assert done.count(5) == 0  # issued 5, the device is behind
    assert done.count(9) == 0
    _FakeEvent.made[0].passed = True
    assert done.count(12) == 5
    _FakeEvent.made[1].passed = _FakeEvent.made[2].passed = True
    assert done.count(12) == 12
    for e in _FakeEvent.made:
        e.passed = True
    assert done.count(12) == 12


def test_on_cpu_issued_is_done():
    assert collprogress.Completed(torch.device("cpu")).count(7) == 7
    assert collprogress.Completed(None).count(7) == 7


def test_flops_per_token_of_the_1b_preset():
    cfg = get_model_config("1b")
    # hand count: per layer attention 2048 x 64 x (2 x 32 + 2 x 8) + MLP 3 x 2048 x 8192 +
    # two norms; the output projection counts, the embedding lookup does not
    per_layer = 2048 * 64 * 80 + 3 * 2048 * 8192 + 2 * 2048
    dense = 16 * per_layer + 128256 * 2048 + 2048
    assert flops_per_token(cfg, 2048) == 6 * dense + 12 * 16 * 2048 * 2048


def test_peak_by_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("Quadro RTX 4000") is None


def test_mfu_arithmetic():
    # 10,000 tokens/s on a device at 6e9 FLOPs per token against 120 TFLOP/s: 50 %
    assert mfu(10_000, 6e9, 120.0) == pytest.approx(0.5)


def test_a_cpu_step_reports_no_mfu_or_device_memory():
    stats = DeviceStats(torch.device("cpu"), get_model_config("tiny"), seq_len=128, ranks=2)
    assert stats.fields(tokens=1024, step_time_s=0.1) == {}
    assert DeviceStats.line({}) == ""
    assert DeviceStats.line({"mfu": 0.4123, "peak_mem_gib": 61.04}) == \
        " | MFU 41.2% | peak mem 61.0 GiB"


def test_deterministic_and_peak_settings():
    cfg = TrainConfig.from_dict({"deterministic": True, "peak_tflops": 989})
    assert cfg.deterministic and cfg.peak_tflops == 989.0
    with pytest.raises(UserError, match="peak_tflops must be positive"):
        TrainConfig.from_dict({"peak_tflops": 0})
    with pytest.raises(UserError, match="deterministic"):
        TrainConfig.from_dict({"deterministic": "yes"})


def test_the_report_gives_the_runs_mfu_and_peak_memory():
    from lazarus.ops import report

    rows = [{"step": s, "loss": 3.0, "grad_norm": 1.0, "lr": 1e-4, "tokens": 16384,
             "step_time_s": 0.25, "mfu": m, "peak_mem_gib": p}
            for s, m, p in ((1, 0.05, 40.0), (2, 0.548, 44.8), (3, 0.55, 44.1))]
    lines = dict(report.summary(report.build(rows, [], [], "t")))
    assert lines["median MFU"] == "54.8%"
    assert lines["peak memory"] == "44.8 GiB per GPU (rank 0)"
    cpu = dict(report.summary(report.build([{k: v for k, v in r.items()
                                             if k not in ("mfu", "peak_mem_gib")} for r in rows],
                                           [], [], "t")))
    assert "median MFU" not in cpu and "peak memory" not in cpu


def test_a_bad_lazarus_device_is_one_clear_error(monkeypatch):
    from lazarus.trainer.device import device_type

    monkeypatch.setenv("LAZARUS_DEVICE", "tpu")
    with pytest.raises(UserError, match="LAZARUS_DEVICE='tpu': must be cpu or cuda"):
        device_type()
    monkeypatch.setenv("LAZARUS_DEVICE", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="torch sees no CUDA device here"):
            device_type()
    monkeypatch.setenv("LAZARUS_DEVICE", "cpu")
    assert device_type() == "cpu"
