"""The disk-full / disk-free chaos kinds: schedule parsing, the ballast on a really small
filesystem (a tmpfs in a user namespace), and the guards against filling a real disk."""

import json
import os
import shutil
import textwrap

import pytest

from lazarus.sim import chaos

from lazarus.sim import diskfault
from lazarus.core.errors import UserError
from tests.unit.mountns import run_in_mount_namespace


def test_disk_faults_parse_in_step_order_without_a_target():
    faults = chaos.parse_schedule("disk-free@20, kill-worker@14,disk-full@8")
    assert [(f.kind, f.step, f.target) for f in faults] == [
        ("disk-full", 8, None), ("kill-worker", 14, None), ("disk-free", 20, None)]
    assert {"disk-full", "disk-free"} <= set(chaos.KINDS)


@pytest.mark.parametrize("spec, expect", [
    ("disk-full@8:n1", "disk-full takes no target"),
    ("disk-free@5", "disk-free@5: the disk is not full by then"),
    ("disk-full@5,disk-full@9", "disk-full@9: the disk is full already by then"),
    ("disk-full@9,disk-free@4", "disk-free@4: the disk is not full by then"),
])
def test_disk_fault_schedule_errors(spec, expect):
    with pytest.raises(UserError, match=expect):
        chaos.parse_schedule(spec)


def test_small_filesystem_is_mounted_only_inside_the_private_namespace(tmp_path, monkeypatch):
    monkeypatch.delenv(diskfault.NAMESPACE_ENV, raising=False)
    with pytest.raises(UserError, match="only inside the private mount namespace"):
        diskfault.mount_small(tmp_path / "ckpt", 32 << 20)
    assert not (tmp_path / "ckpt").exists()


def test_chaos_cli_refuses_to_fill_a_large_filesystem(tmp_path):
    if shutil.disk_usage(tmp_path).total <= diskfault.CLI_MAX_FS_BYTES:
        pytest.skip("the temp dir is on a small filesystem here")
    with pytest.raises(UserError, match="refusing"):
        chaos.main(["disk-full", "--dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="needs --dir"):
        chaos.main(["disk-free"])


def test_checkpoint_fs_holds_the_retained_checkpoints_twice_over():
    one = diskfault.checkpoint_bytes("tiny")
    assert 1 << 20 < one < 4 << 20        # ~125k parameters x (weights + 2 AdamW moments)
    assert diskfault.checkpoint_fs_bytes(one, keep_last=3) == 32 << 20   # the floor
    assert diskfault.checkpoint_fs_bytes(100 << 20, keep_last=3) == 800 << 20


_BALLAST = textwrap.dedent("""
    import json, os, shutil, subprocess, sys
    from pathlib import Path
    from lazarus.sim.diskfault import Ballast
    mnt = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    (mnt / "old").write_bytes(b"x" * 300_000)
    b = Ballast(mnt)
    out = {"ballast": b.fill(), "free_full": shutil.disk_usage(mnt).free}
    os.unlink(mnt / "old")          # a failed save's remains removed: space comes back ...
    b.top_up()                      # ... and is taken again
    out["free_topped"] = shutil.disk_usage(mnt).free
    try:
        (mnt / "probe").write_bytes(b"x" * 4096)
        out["write"] = "ok"
    except OSError as e:
        out["write"] = e.strerror
    out["freed"] = b.free()
    out["free_after"] = shutil.disk_usage(mnt).free
    print(json.dumps(out))
""")


def test_ballast_fills_to_the_last_page_and_free_gives_it_back(tmp_path):
    _, proc = run_in_mount_namespace(tmp_path, _BALLAST)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["free_full"] < 4096 and out["free_topped"] < 4096
    assert out["write"] == "No space left on device"
    assert out["freed"] > out["ballast"] > 1 << 20
    assert out["free_after"] > 2_000_000 - 300_000 - 4096 * 4


def test_up_with_disk_full_says_why_when_no_namespace_can_be_made(tmp_path, monkeypatch):
    """Where user namespaces are disabled (and we are not root), `lazarus up` stops with the
    reason before it starts anything."""
    from lazarus.sim import up
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "unshare").write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not "
                                  "permitted' >&2\nexit 1\n")
    (fake / "unshare").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.delenv(diskfault.NAMESPACE_ENV, raising=False)
    with pytest.raises(UserError, match=r"private mount namespace.*Operation not permitted"):
        up.main(["--workdir", str(tmp_path / "w"), "--chaos", "disk-full@5,disk-free@9"])
    assert not (tmp_path / "w").exists()
