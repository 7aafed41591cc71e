"""Host monitor on real directories: free space, writability (a really full and a really
read-only filesystem, mounted in a user namespace), mounts, memory, I/O errors."""

import dataclasses
import json
import textwrap

import psutil

from lazarus.agent.gpu import DEGRADED, FAILED, HEALTHY
from lazarus.agent.host import (GiB, HostConfig, HostMonitor, HostSample, assess_host,
                                sample_host)
from tests.unit.mountns import run_in_mount_namespace


def config(path, **kw):
    """Thresholds that pass on any machine, except those a test sets."""
    return HostConfig(**{"checkpoint_dir": path, "min_free_bytes": 1, "low_free_bytes": 1,
                         "memory_degraded": 1.01, "memory_failed": 1.01, **kw})


def test_real_tmp_dir_is_healthy_and_the_probe_leaves_nothing(tmp_path):
    monitor = HostMonitor(config(tmp_path))
    verdict = monitor.poll()
    assert verdict.state == HEALTHY, verdict.reasons
    assert monitor.previous.write_error is None
    assert monitor.previous.free_bytes > 0
    assert list(tmp_path.iterdir()) == []


def test_free_space_thresholds(tmp_path):
    free = psutil.disk_usage(str(tmp_path)).free
    low = assess_host(None, sample_host(c := config(tmp_path, low_free_bytes=free * 2)), c)
    assert low.state == DEGRADED
    assert "free (below" in low.reasons[0]
    full = assess_host(None, sample_host(c := config(tmp_path, min_free_bytes=free * 2)), c)
    assert full.state == FAILED
    assert "GiB free, needs" in full.reasons[0]
    # A known checkpoint size raises the floor: the next save would not fit.
    big = config(tmp_path, checkpoint_bytes=free * 2)
    assert assess_host(None, sample_host(big), big).state == FAILED


def test_a_run_directory_not_created_yet_is_judged_by_its_parent(tmp_path):
    # Every round starts before its first save creates the directory: no false alarm.
    c = config(tmp_path / "run" / "checkpoints")
    first = sample_host(c)
    assert not first.exists and first.free_bytes is not None
    assert assess_host(None, first, c).state == HEALTHY
    assert list(tmp_path.iterdir()) == []          # the probe created nothing


def test_checkpoint_dir_that_cannot_be_created_or_disappears_fails(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    c = config(tmp_path / "file" / "checkpoints")
    verdict = assess_host(None, sample_host(c), c)
    assert verdict.state == FAILED
    assert "does not exist and" in verdict.reasons[0]
    (tmp_path / "ck").mkdir()
    monitor = HostMonitor(config(tmp_path / "ck"), hold_s=0)
    assert monitor.poll().state == HEALTHY
    (tmp_path / "ck").rmdir()
    for _ in range(2):   # not one blip: failed for as long as it is gone
        verdict = monitor.poll()
        assert verdict.state == FAILED and "disappeared" in verdict.reasons[0]
        assert not verdict.swap        # storage: a spare would not help
    (tmp_path / "ck").mkdir()
    assert monitor.poll().state == HEALTHY


def test_required_mounts(tmp_path):
    c = config(tmp_path, required_mounts=("/", str(tmp_path)))
    verdict = assess_host(None, sample_host(c), c)
    assert verdict.state == FAILED
    assert verdict.reasons == (f"required mount {tmp_path} is not mounted",)


def test_memory_pressure_thresholds(tmp_path):
    used = sample_host(config(tmp_path)).memory_used
    c = config(tmp_path, memory_degraded=used / 2)
    assert assess_host(None, sample_host(c), c).state == DEGRADED
    c.memory_failed = used / 2
    verdict = assess_host(None, sample_host(c), c)
    assert verdict.state == FAILED and "memory" in verdict.reasons[0]
    assert verdict.swap            # the node's own trouble: a spare helps


def test_rising_io_errors_degrade(tmp_path):
    c = config(tmp_path)
    before = HostSample(checkpoint_dir="/ckpt", free_bytes=100 * GiB, total_bytes=200 * GiB,
                        write_error=None, memory_used=0.2, memory_available_bytes=GiB,
                        io_errors=4)
    same = assess_host(before, before, c)
    assert same.state == HEALTHY
    worse = dataclasses.replace(before, io_errors=6)
    assert assess_host(before, worse, c).reasons == ("2 new I/O errors on the checkpoint device",)
    assert assess_host(None, worse, c).state == HEALTHY   # old errors are not news


_IN_NAMESPACE = textwrap.dedent("""
    import json, os, subprocess, sys
    from pathlib import Path
    from lazarus.agent.host import HostConfig, assess_host, sample_host
    mnt = Path(sys.argv[1]); mode = sys.argv[2]
    opts = "size=64k" + (",ro" if mode == "ro" else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], check=True)
    if mode == "full":
        with open(mnt / "fill", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
    c = HostConfig(checkpoint_dir=mnt, min_free_bytes=0, low_free_bytes=0,
                   memory_degraded=1.01, memory_failed=1.01)
    v = assess_host(None, sample_host(c), c)
    print(json.dumps({"state": v.state, "reasons": v.reasons}))
""")


def _in_user_namespace(tmp_path, mode):
    """Mount a 64 KiB tmpfs in a private mount namespace (no root needed where user
    namespaces are allowed) and assess it there; nothing leaks to the host."""
    _, proc = run_in_mount_namespace(tmp_path, _IN_NAMESPACE, mode)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_full_filesystem_fails_the_write_probe(tmp_path):
    verdict = _in_user_namespace(tmp_path, "full")
    assert verdict["state"] == FAILED
    assert "is not writable (ENOSPC: No space left on device)" in verdict["reasons"][0]


def test_read_only_filesystem_fails_the_write_probe(tmp_path):
    verdict = _in_user_namespace(tmp_path, "ro")
    assert verdict["state"] == FAILED
    assert "is not writable (EROFS: Read-only file system)" in verdict["reasons"][0]


def test_free_space_alerts_have_hysteresis_and_a_minimum_duration(tmp_path):
    """Free space hovering at the threshold raises one alert, not one per sample: the alert
    is reported once it lasted HOLD_S, and clears only 10% above the threshold, once that
    lasted HOLD_S too. The disk is the real one; the threshold moves around its free space."""
    free = psutil.disk_usage(str(tmp_path)).free
    c = config(tmp_path, min_free_bytes=int(free * 1.05))   # 5% short of the floor
    monitor = HostMonitor(c, hold_s=3.0)
    t = 1000.0
    assert monitor.poll(t).state == HEALTHY                # seen, not reported yet
    assert monitor.poll(t + 2.9).state == HEALTHY
    verdict = monitor.poll(t + 3.0)
    assert verdict.state == FAILED and "free, needs" in verdict.reasons[0]
    # back just above the floor (within 10% of it): still failed, however long
    c.min_free_bytes = int(free * 0.95)
    assert [monitor.poll(t + 3 + i).state for i in range(1, 10)] == [FAILED] * 9
    # well above it: healthy once that lasted HOLD_S
    c.min_free_bytes = int(free * 0.85)
    assert monitor.poll(t + 20).state == FAILED
    assert monitor.poll(t + 22).state == FAILED
    assert monitor.poll(t + 23).state == HEALTHY
    # a single bad sample is no alert
    c.min_free_bytes = int(free * 1.05)
    assert monitor.poll(t + 30).state == HEALTHY
    c.min_free_bytes = int(free * 0.5)
    assert [monitor.poll(t + 30 + i).state for i in range(1, 6)] == [HEALTHY] * 5
