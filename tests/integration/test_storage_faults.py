"""Storage that fails under a save: the disk fills up DURING a checkpoint, not before it.

`lazarus train` (2 ranks) runs in a private mount namespace (unshare(1)) with its checkpoint
dir on a small tmpfs holding a ballast file: the first checkpoint fits, the second runs out of
space midway through its shard files. That costs the second checkpoint only: training goes
on, the partial directory is removed, and once the test deletes the ballast (through the
namespace's /proc/PID/root view) the next checkpoint commits, and so does the last.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lazarus.trainer.ckptlist import committed_checkpoints
from lazarus.trainer.ckptverify import verify_checkpoint

# A checkpoint of the tiny model at 2 ranks is 1.83 MB (two shards of 0.85 and 0.91 MB):
# with 1.8 MB of ballast, 4.6 MB leave room for one checkpoint and about half of a second.
TMPFS_KIB = 4600
BALLAST_BYTES = 1_800_000
STEPS = 12


def _private_mount_works() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _private_mount_works(), reason="needs unshare --mount (root)")
def test_a_disk_that_fills_during_a_save_costs_that_checkpoint_only(tmp_path):
    ck, saved, metrics = tmp_path / "ck", tmp_path / "saved", tmp_path / "metrics.jsonl"
    ck.mkdir()
    log = tmp_path / "train.log"
    script = (f"mount -t tmpfs -o size={TMPFS_KIB}k tmpfs {ck} && "
              f"head -c {BALLAST_BYTES} /dev/zero > {ck}/.ballast && "
              f"{sys.executable} -m lazarus.cli train --nproc 2 --steps {STEPS} --seq-len 64 "
              f"--global-batch 8 --ckpt-dir {ck} --ckpt-every 2 --keep-last 1 "
              f"--metrics {metrics}; rc=$?; cp -r {ck} {saved}; exit $rc")
    with open(log, "wb") as out:
        proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", script], stdout=out,
                                stderr=subprocess.STDOUT)
    # The tmpfs as the namespace sees it: this process's own view of ck is the empty dir.
    inside = Path(f"/proc/{proc.pid}/root") / ck.relative_to("/")
    try:
        deadline = time.monotonic() + 300
        while "not written" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        (inside / ".ballast").unlink()              # space is back
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    failed = [line for line in text.splitlines() if "not written, nothing committed" in line]
    # The save ran out of room midway: torch's zip writer says so as a short write, the
    # file system as ENOSPC; either way only that checkpoint is lost.
    assert failed and all("short write" in line or "No space left on device" in line
                          for line in failed), text[-3000:]
    first_failed = int(failed[0].split("checkpoint step ")[1].split()[0])
    assert first_failed == 4, failed                # step 2's fitted, step 4's did not
    # Training went on through it, and the last checkpoint committed once space was back.
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == STEPS, text[-3000:]
    (path, manifest), = committed_checkpoints(saved)   # keep_last 1
    assert manifest["step"] == STEPS
    verify_checkpoint(path)
    # The failed saves left nothing behind that could be taken for a checkpoint.
    assert sorted(p.name for p in saved.iterdir() if p.name.startswith("step-")) == [path.name]
