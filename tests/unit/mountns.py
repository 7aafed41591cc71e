"""Run a Python script in a private user + mount namespace, where it may mount a small
tmpfs without root and without the host seeing it; skip where the machine forbids that."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_in_mount_namespace(tmp_path: Path, script: str, *args: str,
                           timeout: float = 60) -> tuple[Path, subprocess.CompletedProcess]:
    """(mount point handed to the script as argv[1], the finished process)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) not installed")
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable,
                           "-c", script, str(mnt), *args],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and "mount" in proc.stderr and "Operation not permitted" in proc.stderr:
        pytest.skip("user namespaces cannot mount here")
    return mnt, proc
