"""Each preflight check's verdict, from the real thing: the simulated GPU backend with a
fault script, files on a real (and a really full, a really read-only) filesystem, DCP, a real
etcd's clock, gloo over loopback in the child process that would run NCCL (and one that hangs
or dies as NCCL can)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lazarus.agent import clockskew
from lazarus.agent import collective_check as coll
from lazarus.agent import preflight as P
from lazarus.agent.gpu import GpuMonitor
from lazarus.agent.gpu_sim import SimulatedBackend, add_fault
from lazarus.core import etcd as E
from lazarus.core.embedded_etcd import EmbeddedEtcd, free_port
from tests.unit.mountns import run_in_mount_namespace


def monitor(tmp_path: Path, gpus: int, *faults: dict) -> GpuMonitor:
    script = tmp_path / "faults.json"
    for f in faults:
        add_fault(script, f)
    return GpuMonitor(SimulatedBackend(gpus=gpus, script=script))


def test_healthy_gpus_pass(tmp_path):
    m = monitor(tmp_path, 2)
    ok, reason = P.gpus(m.poll(), 2, "sim")
    assert ok and reason == "2 GPUs healthy (sim)"


def test_a_gpu_with_an_uncorrectable_ecc_error_fails_and_is_named(tmp_path):
    m = monitor(tmp_path, 2, {"gpu": 1, "fault": "ecc-dbe"})
    ok, reason = P.gpus(m.poll(), 2, "sim")
    assert not ok
    assert reason.startswith("GPU 1 failed: ") and "uncorrectable ECC" in reason
    assert "GPU 0" not in reason


def test_a_degraded_gpu_fails_too(tmp_path):
    m = monitor(tmp_path, 1, {"gpu": 0, "fault": "thermal"})
    ok, reason = P.gpus(m.poll(), 1, "sim")
    assert not ok and "GPU 0 degraded" in reason and "slowdown" in reason


def test_fewer_gpus_than_ranks_fail(tmp_path):
    m = monitor(tmp_path, 1)
    assert P.gpus(m.poll(), 2, "sim") == (False, "1 of 2 GPUs visible (sim)")


def test_storage_round_trip_passes_and_leaves_nothing(tmp_path):
    a, b = tmp_path / "work", tmp_path / "ckpt"
    a.mkdir(), b.mkdir()
    ok, reason = P.storage([a, b], 2 * P.MiB)
    assert ok and str(a) in reason and str(b) in reason
    assert list(a.iterdir()) == [] and list(b.iterdir()) == []


def test_a_checkpoint_dir_not_made_yet_is_no_failure(tmp_path):
    ok, reason = P.storage([tmp_path, tmp_path / "later"], P.MiB)
    assert ok and f"{tmp_path / 'later'} not there yet" in reason
    assert P.checkpoint_round_trip(tmp_path / "later")[0]


def test_checkpoint_round_trip_through_dcp(tmp_path):
    ok, reason = P.checkpoint_round_trip(tmp_path)
    assert ok and "saved and loaded through DCP" in reason
    assert list(tmp_path.iterdir()) == []


# The driver mounts a 1 MiB tmpfs (full for a 4 MiB write), then a read-only one, in a
# private mount namespace: as root (CI) a chmod would not stop a write.
_STORAGE_FAULTS = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    from lazarus.agent import preflight as P
    mnt = Path(sys.argv[1])
    out = {}
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    out["full"] = P.timed("storage", lambda: P.storage([mnt], 4 * P.MiB)).reason
    out["full_ckpt"] = P.timed("checkpoint", lambda: P.checkpoint_round_trip(mnt)).reason
    out["left"] = sorted(p.name for p in mnt.iterdir())
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    out["ro"] = P.timed("storage", lambda: P.storage([mnt], P.MiB)).reason
    out["ro_ckpt"] = P.timed("checkpoint", lambda: P.checkpoint_round_trip(mnt)).reason
    print(json.dumps(out))
""")


def test_a_full_and_a_read_only_checkpoint_dir_fail_with_the_reason(tmp_path):
    mnt, proc = run_in_mount_namespace(tmp_path, _STORAGE_FAULTS, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["full"] == f"{mnt}: ENOSPC: No space left on device", out
    assert out["full_ckpt"] == f"{mnt}: ENOSPC: No space left on device", out
    assert out["left"] == []        # what a failed check wrote is gone
    assert out["ro"] == f"{mnt}: EROFS: Read-only file system", out
    assert out["ro_ckpt"] == f"{mnt}: EROFS: Read-only file system", out


@pytest.fixture(scope="module")
def etcd():
    with EmbeddedEtcd() as server:
        client = E.Etcd(server.endpoint)
        yield client
        client.close()


def test_clock_against_the_etcd_leader(etcd):
    ok, reason = P.clock(etcd, 0.5)
    assert ok and "the etcd leader's" in reason


def test_a_clock_three_seconds_ahead_fails(etcd):
    ok, reason = P.clock(etcd, 0.5, now=lambda: time.time() + 3.0)
    assert not ok
    assert "ahead of the etcd leader's" in reason and "limit 0.5 s" in reason
    offset = float(reason.split()[1])
    assert 2.8 < offset < 3.2


def test_skew_is_judged_at_its_most_favourable_reading():
    # 0.7 s off, give or take 0.3: it may be 0.4, within a 0.5 s limit
    assert clockskew.judge(clockskew.Skew(0.7, 0.3, 10), 0.5)[0]
    ok, reason = clockskew.judge(clockskew.Skew(-0.9, 0.3, 10), 0.5)
    assert not ok and reason.startswith("clock 0.900 s ahead of")


def test_collective_over_loopback_measures_bandwidth():
    ok, reason = coll.collective(coll.loopback_peers("127.0.0.1"), 0, nbytes=P.MiB,
                              min_bus_gbps=0.0)
    assert ok and reason.startswith("gloo all-reduce of 1 MiB over 2 ranks")
    assert float(reason.split(": ")[1].split()[0]) > 0


def test_collective_below_the_bandwidth_floor_fails():
    ok, reason = coll.collective(coll.loopback_peers("127.0.0.1"), 0, nbytes=P.MiB,
                              min_bus_gbps=1e6)
    assert not ok and reason.endswith("below 1e+06 GB/s")


def test_a_collective_whose_peer_never_comes_fails_with_the_reason():
    port = free_port()
    ok, reason = coll.collective([f"127.0.0.1:{port}", "127.0.0.1:1"], 0, nbytes=P.MiB,
                              min_bus_gbps=0.0, timeout_s=2.0)
    assert not ok and reason.startswith("gloo rank 0"), reason


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_collective_test_that_hangs_is_killed_and_the_caller_lives(tmp_path, monkeypatch):
    # a child stuck as a hung NCCL would be: deaf to its own timeouts
    pidfile = tmp_path / "pid"
    monkeypatch.setattr(coll, "child_command", lambda: [
        sys.executable, "-c", "import os, sys, time; "
        "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)", str(pidfile)])
    monkeypatch.setattr(coll, "CHILD_START_S", 1.0)
    start = time.monotonic()
    ok, reason = coll.collective(coll.loopback_peers("127.0.0.1"), 0, nbytes=P.MiB,
                                 min_bus_gbps=0.0, timeout_s=1.0)
    assert (ok, reason) == (False, "no result within 2 s (the test's process was killed)")
    assert time.monotonic() - start < 10
    assert _gone(int(pidfile.read_text()))


def test_a_collective_test_whose_process_dies_fails_with_its_last_words(monkeypatch):
    # NCCL's watchdog aborts its process on a timeout: this one is the test's, not the agent's
    monkeypatch.setattr(coll, "child_command", lambda: [
        sys.executable, "-c", "import os, sys; print('NCCL INFO Bootstrap'); "
        "print('watchdog caught collective timeout', file=sys.stderr, flush=True); os.abort()"])
    ok, reason = coll.with_peer("n0", "127.0.0.1", 1, host="127.0.0.1", nbytes=P.MiB,
                                min_bus_gbps=0.0)
    assert (ok, reason) == (False, "the test's process died (killed by SIGABRT): watchdog "
                                   "caught collective timeout")


def test_the_verdict_is_found_among_nccls_own_lines(monkeypatch):
    monkeypatch.setattr(coll, "child_command", lambda: [
        sys.executable, "-c", "print('NCCL INFO Bootstrap'); "
        "print('lazarus-collective-result [true, \"all good\"]'); print('NCCL INFO comm 0x1')"])
    assert coll.in_child("collective", {}, 30.0) == (True, "all good")


def test_the_test_process_goes_with_the_agent():
    """Its stdin is its lifeline: an agent that dies (or gives up) closes it."""
    port = free_port()
    request = {"test": "collective", "peers": [f"127.0.0.1:{port}", "127.0.0.1:1"],
               "rank": 0, "nbytes": P.MiB, "min_bus_gbps": 0.0, "timeout_s": 120.0}
    child = subprocess.Popen([*coll.child_command(), json.dumps(request)],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        # rank 0 hosts the store and waits for rank 1, which never comes
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and child.poll() is None
                time.sleep(0.1)
        child.stdin.close()
        assert child.wait(10) == 3
    finally:
        child.kill()
        child.wait()


def test_summary_is_small_and_names_what_failed():
    checks = [P.Check("gpu", True, "ok", 0.01), P.Check("storage", False, "ENOSPC " * 100, 0.2),
              P.Check("clock", False, "clock 3 s ahead", 0.6)]
    s = P.summary(checks, at=5.0)
    assert s["state"] == "failed" and s["cost_s"] == 0.81 and s["at"] == 5.0
    assert s["reason"].startswith("storage: ENOSPC") and len(s["reason"]) == P.REASON_CHARS
    assert len(json.dumps(s)) < 400
    assert P.summary(checks[:1], at=5.0)["reason"] == ""


def test_checks_run_at_the_first_idle_pass_then_every_period_while_idle():
    go = threading.Event()
    r = P.Runner(every_s=60.0, run=lambda: [] if go.wait(60) else [], on_done=lambda: None)
    assert not r.due(0.0, idle=False)      # an adopted round runs: not under its feet
    assert r.due(0.0, idle=True) and r.busy  # its first verdict not in yet
    r.poll(0.0, idle=True)
    assert r.busy
    go.set()
    r._thread.join()
    assert r.state == "passed" and not r.busy
    assert not r.due(59.0, idle=True) and not r.due(61.0, idle=False)
    assert r.due(61.0, idle=True)
    once = P.Runner(every_s=0.0, run=lambda: [], on_done=lambda: None)
    once.poll(0.0, idle=True)
    once._thread.join()
    assert not once.due(1e9, idle=True)


def test_an_idle_node_tests_its_collective_path_with_a_members_agent():
    import torch.distributed as dist

    # the member's agent: its store, served twice a second by its loop
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    serving = coll.PeerTests(store, host="127.0.0.1", port=store.port)
    done = threading.Event()

    def loop():
        while not done.is_set():
            serving.poll()
            time.sleep(0.05)

    threading.Thread(target=loop, daemon=True).start()
    try:
        ok, reason = coll.with_peer("n0", "127.0.0.1", store.port, host="127.0.0.1",
                                    nbytes=P.MiB, min_bus_gbps=0.0)
        assert ok and reason.startswith("gloo all-reduce of 1 MiB with n0: "), reason
        ok, reason = coll.with_peer("n0", "127.0.0.1", store.port, host="127.0.0.1",
                                    nbytes=P.MiB, min_bus_gbps=1e6)
        assert not ok and reason.endswith("below 1e+06 GB/s")
    finally:
        done.set()


def test_a_member_that_serves_no_tests_is_no_verdict():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ok, reason = coll.with_peer("old", "127.0.0.1", store.port, host="127.0.0.1",
                                nbytes=P.MiB, min_bus_gbps=0.0, ack_s=0.5)
    assert ok and reason == "skipped: old does not serve collective tests"


def test_a_leader_url_this_node_cannot_reach_is_a_skip_not_a_cordon(etcd, monkeypatch):
    port = free_port()   # nothing listens there
    monkeypatch.setattr(etcd, "leader_url", lambda: f"http://127.0.0.1:{port}")
    check = P.timed("clock", lambda: P.clock(etcd, 0.5))
    assert check.ok and check.skipped
    assert check.reason.startswith(f"skipped: the etcd leader's client URL "
                                   f"http://127.0.0.1:{port}/version did not answer")
