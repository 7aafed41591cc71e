"""The disk-full fault: the checkpoint dir on a small filesystem of its own, filled and freed.

`lazarus up` with disk-full in its schedule runs itself inside a private mount namespace
(unshare(1): `--mount` as root, `--user --map-root-user --mount` otherwise). The size-limited
tmpfs it mounts over the checkpoint dir is then seen by every process of the local cluster
(they are its children) and by nothing else on the host, and it goes away with them: a crash
leaves no mount behind, and filling it cannot touch a real disk. Networking is untouched.

Filling writes a ballast file until the filesystem refuses (ENOSPC), leaving less than a page
free; freeing deletes it.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

from lazarus.core.errors import UserError

# Set in the environment of a `lazarus up` that runs in its own mount namespace.
NAMESPACE_ENV = "LAZARUS_PRIVATE_MOUNTS"
BALLAST = ".lazarus-ballast"
MiB = 1 << 20
# `lazarus chaos disk-full --dir` fills whatever filesystem holds the directory: refuse one
# this large, which is a real disk far more likely than a test mount.
CLI_MAX_FS_BYTES = 4 << 30


def in_private_namespace() -> bool:
    return os.environ.get(NAMESPACE_ENV) == "1"


def _unshare_prefix() -> list[str]:
    if shutil.which("unshare") is None:
        raise UserError("disk-full needs unshare(1) (util-linux) to give the local cluster a "
                        "private mount namespace for its small checkpoint filesystem")
    if os.geteuid() == 0:
        return ["unshare", "--mount"]
    return ["unshare", "--user", "--map-root-user", "--mount"]


def rerun_in_namespace(argv: list[str]) -> None:
    """Replace this process by `python -m lazarus.cli ARGV...` in a private mount namespace
    (returns only by raising UserError when that is impossible here)."""
    prefix = _unshare_prefix()
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise UserError("disk-full needs a private mount namespace for the small checkpoint "
                        f"filesystem, and `{' '.join(prefix)}` failed here "
                        f"({probe.stderr.strip() or f'exit {probe.returncode}'}); run as root, "
                        "or allow unprivileged user namespaces")
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[NAMESPACE_ENV] = "1"
    os.execvp(prefix[0], [*prefix, sys.executable, "-m", "lazarus.cli", *argv])


def mount_small(path: Path, size_bytes: int) -> None:
    """Mount a tmpfs of `size_bytes` over `path` (created if missing). Only inside the
    namespace rerun_in_namespace made: anywhere else it would be the host's mount table."""
    if not in_private_namespace():
        raise UserError("disk-full: the small checkpoint filesystem is mounted only inside the "
                        "private mount namespace that the `lazarus up` command makes; run it "
                        "through that command")
    path.mkdir(parents=True, exist_ok=True)
    size_kib = max(1, size_bytes // 1024)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs",
                           str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"disk-full: cannot mount a {size_kib // 1024} MiB tmpfs on {path}: "
                        f"{proc.stderr.strip() or f'mount exit {proc.returncode}'}")


def checkpoint_bytes(model: str) -> int:
    """About what one checkpoint of `model` takes: fp32 weights and AdamW's two moments, plus
    a generous MiB for DCP's metadata, the RNG states and the manifest."""
    import torch

    # lazily, torch too: `lazarus chaos` imports this module and runs without torch
    from lazarus.trainer.models import Transformer, get_model_config

    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(get_model_config(model)).parameters())
    return 12 * params + MiB


def checkpoint_fs_bytes(checkpoint_bytes: int, keep_last: int) -> int:
    """Room for the retained checkpoints plus one being written, twice over, at least 32 MiB."""
    return max(32 * MiB, 2 * (keep_last + 1) * checkpoint_bytes)


class Ballast:
    """The file that fills the filesystem holding `directory`."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / BALLAST
        self.full = False

    def fill(self) -> int:
        """Write until the filesystem refuses; returns the ballast's size. Calling it again
        takes back space freed since (a failed save's remains removed, say)."""
        try:
            with open(self.path, "ab", buffering=0) as f:
                for chunk in (b"\0" * MiB, b"\0" * 4096):
                    while True:
                        f.write(chunk)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        self.full = True
        return self.path.stat().st_size

    def top_up(self) -> None:
        if self.full:
            self.fill()

    def free(self) -> int:
        """Delete the ballast; returns how many bytes that gave back."""
        self.full = False
        try:
            size = self.path.stat().st_size
            self.path.unlink()
        except FileNotFoundError:
            return 0
        return size


def chaos_cli(kind: str, directory: Path) -> str:
    """`lazarus chaos disk-full|disk-free --dir DIR` on a running cluster (fills once: space
    freed later is not taken back)."""
    if not directory.is_dir():
        raise UserError(f"{kind}: {directory} is not a directory")
    total = shutil.disk_usage(directory).total
    ballast = Ballast(directory)
    if kind == "disk-free":
        return f"disk-free: {ballast.free() / MiB:.1f} MiB given back in {directory}"
    if total > CLI_MAX_FS_BYTES:
        raise UserError(f"disk-full fills the whole filesystem holding {directory}, and that one "
                        f"has {total / (1 << 30):.1f} GiB: refusing (mount a small tmpfs there "
                        f"first; at most {CLI_MAX_FS_BYTES >> 30} GiB)")
    return f"disk-full: {directory} filled with {ballast.fill() / MiB:.1f} MiB of ballast"
