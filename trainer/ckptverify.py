"""Verifying a committed checkpoint before a restore: its manifest and every file's size and
checksum, with what each rank found wrong (RestoreFailed: corrupt, missing, unreadable), so
that the daemon can tell a checkpoint that is wrong from a node that cannot read it."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from lazarus.core.contract import ABSENT, CORRUPT, UNREADABLE
from lazarus.core.errors import CheckpointError, RestoreFailed
from lazarus.trainer import exchange
from lazarus.trainer.ckptfiles import MANIFEST, OWNER, STEP_DIR, sha256_file
from lazarus.trainer.ckptlist import read_manifest


def _inspect(path: Path, rank: int, world: int) -> tuple[dict | None, tuple[str, str] | None]:
    """What this rank finds wrong with checkpoint `path`, hashing its share of the files:
    (the manifest if it could be read, (kind, reason) or None). The kinds (lazarus.core.contract)
    tell the checkpoint's fault from this node's: a checksum that fails is the checkpoint's;
    a root, a directory or a file this node cannot see or read while others can is the
    node's, which only the daemon, comparing every node's finding, can tell."""
    root = path.parent
    try:
        in_root = os.listdir(root)
    except FileNotFoundError:
        return None, (UNREADABLE, f"checkpoint root {root} is not there on this node (a storage "
                                  "mount missing?)")
    except OSError as e:
        return None, (UNREADABLE, f"checkpoint root {root} cannot be read: {e.strerror or e}")
    try:
        names = set(os.listdir(path))
    except FileNotFoundError:
        if OWNER not in in_root and not any(STEP_DIR.fullmatch(n) for n in in_root):
            # No trace of any checkpoint: not the storage the job wrote to (a mount missing
            # here, an empty directory in its place), not a checkpoint deleted from it.
            return None, (UNREADABLE, f"checkpoint root {root} holds no checkpoints on this node "
                                      f"(no {OWNER}, no step-*): its storage is not mounted here?")
        return None, (ABSENT, f"checkpoint {path} does not exist")
    except OSError as e:
        return None, (UNREADABLE, f"checkpoint {path} cannot be read: {e.strerror or e}")
    if MANIFEST not in names:
        return None, (ABSENT, f"checkpoint {path} is incomplete: no {MANIFEST} (the save never "
                               "committed)")
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return None, (CORRUPT, str(e))
    except OSError as e:
        return None, (UNREADABLE, f"{path / MANIFEST} cannot be read: {e.strerror or e}")
    # Every rank checks that every listed file is there (one listing); a file missing for one
    # node and not for the others is that node's view, not the checkpoint.
    if absent := [e["name"] for e in manifest["files"] if e["name"] not in names]:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        return manifest, (ABSENT, f"{absent[0]} is missing{more} (checkpoint {path} is "
                                   "incomplete)")
    for entry in manifest["files"][rank::world]:
        f = path / entry["name"]
        try:
            size = f.stat().st_size
            if size != entry["bytes"]:
                return manifest, (CORRUPT, f"{entry['name']} has {size} bytes, the manifest says "
                                           f"{entry['bytes']} (checkpoint {path} is corrupt)")
            if sha256_file(f) != entry["sha256"]:
                return manifest, (CORRUPT, f"{entry['name']} fails its sha256 checksum "
                                           f"(checkpoint {path} is corrupt)")
        except OSError as e:
            return manifest, (UNREADABLE, f"{entry['name']} cannot be read: {e.strerror or e} "
                                          f"(checkpoint {path})")
    return manifest, None


def verify_checkpoint(path: Path) -> dict:
    """Manifest and every file's checksum, in this process; returns the manifest."""
    manifest, problem = _inspect(Path(path), 0, 1)
    if problem is not None:
        raise RestoreFailed(problem[1], kind=problem[0], own=problem[1])
    return manifest


def verify_collectively(path: Path) -> dict:
    """verify_checkpoint with the hashing split across ranks. Every rank raises RestoreFailed
    with the first problem any rank found (none is left waiting in a collective the others
    abandoned), each with its own finding: the daemon compares the nodes' findings."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest, problem = _inspect(Path(path), rank, world)
    problems = exchange.all_gather(problem)  # (kind, reason) pairs come back as lists
    # The checkpoint's own fault first: it names what to condemn.
    found = sorted((p for p in problems if p), key=lambda p: p[0] != CORRUPT)
    if found:
        kind, own = problem if problem else ("", "")
        raise RestoreFailed(found[0][1], kind=kind, own=own)
    assert manifest is not None
    return manifest
