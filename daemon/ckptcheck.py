"""Whether a checkpoint record may be restored: the daemon's check before it names one in a
round (docs/security.md, "A compromised agent").

Checkpoint records are written by agents, and every agent's etcd role may write any of them:
a record alone proves nothing. One is restored only if
- its path lies inside the job's checkpoint dir (`train.checkpoint.dir`, relative to the
  job's cwd; '..' and symlinks resolved, as far as the daemon sees the filesystem), one level
  down, in a directory named like the trainer names its steps (step-<step:08d>), for the
  record's step; and
- where the daemon sees that dir (a local cluster, a shared mount), the manifest there names
  the job's id and the record's step. Where it does not (a daemon off the storage), the path
  checks are all there is, and the ranks' own check of the files against the manifest's
  checksums on restore.
A job that runs its own script names no checkpoint dir: its records are taken as they are.
A record that fails is skipped, never deleted: the reason goes into an event.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable

from lazarus.core.jobspec import JobSpec
from lazarus.core.records import CheckpointRecord

# The trainer's names (lazarus.trainer.checkpoint, which needs torch: not imported here).
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")
# A manifest lists one line per file of every rank; far below this.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


def checkpoint_dir(job: JobSpec) -> str | None:
    """The job's checkpoint dir as the ranks see it (relative to the job's cwd), or None."""
    ck = job.train.get("checkpoint") if isinstance(job.train, dict) else None
    d = ck.get("dir") if isinstance(ck, dict) else None
    if not isinstance(d, str) or not d:
        return None
    return os.path.join(job.cwd, d) if job.cwd and not os.path.isabs(d) else d


def _read_manifest(path: str) -> dict | str | None:
    """The manifest in `path`; None when the daemon cannot see the checkpoint dir at all;
    a reason when it sees it and the manifest is missing or unreadable."""
    if not os.path.isdir(os.path.dirname(path)):
        return None
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        return f"its manifest is unreadable ({e.strerror})"
    if len(raw) > MAX_MANIFEST_BYTES:
        return "its manifest is too large"
    try:
        doc = json.loads(raw)
    except ValueError:
        return "its manifest is not JSON"
    return doc if isinstance(doc, dict) else "its manifest is not a JSON object"


# Verdicts on records already checked against the storage. A record is written once its
# step's manifest is durable and rewritten (a new committed_at) when the step is saved again,
# so its verdict holds: the decision passes and retention that ask again and again read no
# manifest twice. Bounded: the oldest go first.
_VERDICTS: OrderedDict[tuple, str | None] = OrderedDict()
MAX_VERDICTS = 4096


def why_not(rec: CheckpointRecord, job: JobSpec,
            read_manifest: Callable[[str], dict | str | None] = _read_manifest) -> str | None:
    """Why `rec` must not be restored for `job`; None when it may."""
    if read_manifest is not _read_manifest:
        return _why_not(rec, job, read_manifest)
    key = (job.id, job.cwd, checkpoint_dir(job), rec.path, rec.step, rec.committed_at)
    if key in _VERDICTS:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]
    verdict = _VERDICTS[key] = _why_not(rec, job, read_manifest)
    while len(_VERDICTS) > MAX_VERDICTS:
        _VERDICTS.popitem(last=False)
    return verdict


def _why_not(rec: CheckpointRecord, job: JobSpec,
             read_manifest: Callable[[str], dict | str | None]) -> str | None:
    root = checkpoint_dir(job)
    if root is None:
        # A job of its own script (no built-in trainer) names no dir the daemon could hold
        # its records to: nothing to check them against.
        return None
    if not rec.path or "\0" in rec.path:
        return "its path is empty"
    path = rec.path if os.path.isabs(rec.path) or not job.cwd else os.path.join(job.cwd, rec.path)
    if ".." in path.split(os.sep):
        return f"its path {rec.path!r} has '..' in it"
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.dirname(real) != real_root:
        return f"its path {rec.path!r} is not a directory of the job's checkpoint dir {root}"
    m = _STEP_DIR.fullmatch(os.path.basename(real))
    if m is None or int(m.group(1)) != rec.step:
        return f"its path {rec.path!r} is not the directory of step {rec.step}"
    manifest = read_manifest(real)
    if manifest is None:
        return None  # the daemon does not see the storage: the path checks are all it has
    if isinstance(manifest, str):
        return manifest
    if manifest.get("job_id") != job.id:
        return f"its manifest is job {str(manifest.get('job_id'))[:64]!r}'s, not {job.id!r}'s"
    step = manifest.get("step")
    if isinstance(step, bool) or step != rec.step:
        return f"its manifest is of step {str(step)[:32]}, not {rec.step}"
    return None
