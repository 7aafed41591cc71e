"""Listing a checkpoint root's committed checkpoints, and reading their manifests.

No torch here: `lazarus train` (trainer/launch.py) lists checkpoints before it forks ranks.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from lazarus.core.errors import CheckpointError
from lazarus.trainer.ckptfiles import FORMAT_VERSION, MANIFEST, STEP_DIR

log = logging.getLogger(__name__)

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory `path`; CheckpointError if it has none, or one
    that is malformed (naming what is wrong)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save never "
                              f"committed)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{mpath} is malformed (not JSON: {str(e)[:80]})") from None
    if problem := _manifest_problem(manifest):
        raise CheckpointError(f"{mpath} is malformed: {problem}")
    return manifest


def is_whole(value) -> bool:
    """A manifest's count or size: an int (not a bool), not negative."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_problem(manifest) -> str | None:
    """What in a manifest the listing and the checks read is not as a save writes it. Anyone
    who can write the checkpoint dir can write a manifest: a file name in it is joined to the
    checkpoint's path, so it must name a file in that directory, never "../../etc/passwd" or
    "/etc/shadow"; and a field of the wrong type must be a bad checkpoint here, not a
    TypeError later that the worker would take for a crash."""
    if not isinstance(manifest, dict):
        return f"not a JSON object but a {type(manifest).__name__}"
    if (version := manifest.get("format_version")) != FORMAT_VERSION:
        return f"format_version is {str(version)[:20]!r}, not {FORMAT_VERSION}"
    for field in ("step", "commit_seq"):
        if not is_whole(manifest.get(field)):
            return f"{field} is {str(manifest.get(field))[:20]!r}, not a whole number"
    if not isinstance(manifest.get("job_id", ""), str):
        return "job_id is not a string"
    files = manifest.get("files")
    if not isinstance(files, list):
        return "files is not a list"
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            return f"files[{i}] is not an object"
        if missing := [k for k in ("name", "bytes", "sha256") if k not in entry]:
            return f"files[{i}] has no {missing[0]!r}"
        name = entry["name"]
        if not isinstance(name, str):
            return f"files[{i}].name is a {type(name).__name__}, not a file name"
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            return (f"files[{i}].name {name[:80]!r} is not the name of a file in the "
                    "checkpoint directory")
        if not is_whole(entry["bytes"]):
            return f"files[{i}].bytes is {str(entry['bytes'])[:20]!r}, not a size"
        if not isinstance(entry["sha256"], str) or not _SHA256_RE.fullmatch(entry["sha256"]):
            return f"files[{i}].sha256 is not a sha256 digest"
    return None


def committed_checkpoints(root: Path) -> list[tuple[Path, dict]]:
    """Committed checkpoints under `root`, oldest commit first, with their manifests.

    Ordered by commit, not by step: after a rollback the newest commit is the run's present,
    even if an abandoned timeline left checkpoints with higher step numbers.
    """
    root = Path(root)
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if not STEP_DIR.fullmatch(d.name) or not (d / MANIFEST).is_file():
                continue
            try:
                found.append((d, read_manifest(d)))
            except CheckpointError as e:
                log.warning("ignoring checkpoint: %s", e)
    return sorted(found, key=lambda pm: pm[1]["commit_seq"])


def latest_checkpoint(root: Path) -> Path | None:
    """The most recently committed checkpoint under `root` (never an incomplete one)."""
    committed = committed_checkpoints(root)
    return committed[-1][0] if committed else None
