"""A checkpoint directory's names, and the small file helpers its writers and readers share.

No torch here: `lazarus train` lists checkpoints (trainer/ckptlist.py) before it forks ranks,
and the corpus writer (trainer/data.py) hashes its files with the same helper.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

MANIFEST = "manifest.json"
OWNER = ".lazarus-job"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"step-(\d+)")


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write via a temporary name + fsync + rename, so `path` is absent or complete. The
    temporary name is the writer's own: two writers of one file at once (every replica's
    rank 0 claiming a job's checkpoint dir, docs/replicas.md) each rename a whole file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not pile up writers' leftovers
        raise
    fsync_dir(path.parent)


def file_entry(directory: Path, name: str) -> dict:
    """A manifest's line for one file: its name, size and sha256."""
    path = directory / name
    return {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
