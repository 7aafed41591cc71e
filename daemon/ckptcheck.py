"""Which agents' claims of a commit become checkpoint records, and whether a record may be
restored: the leader's checks (docs/security.md, "A compromised agent").

An agent reports a commit as a claim (ckptclaims/<step>); only the leader writes records
(checkpoints/). Every agent's etcd role may write any claim: a claim alone proves nothing. One
is adopted (`adopt_claims`) only if it is of the run's job and
- its path lies inside the job's checkpoint dir (`train.checkpoint.dir`, relative to the
  job's cwd; '..' and symlinks resolved, as far as the daemon sees the filesystem), one level
  down, in a directory named like the trainer names its steps (step-<step:08d>), for the
  claim's step; and
- where the daemon sees that dir (a local cluster, a shared mount), the manifest there names
  the job's id and the claim's step. Where it does not (a daemon off the storage), the path
  checks are all there is, and the ranks' own check of the files against the manifest's
  checksums on restore.
The job's ranks write that dir, so the manifest is read as a file they control
(lazarus.core.jobfile: no FIFO, symlink or giant), and the storage in threads beside the
decision pass, which waits for it READ_WAIT_S at most (docs/security.md, "The job's own code").
A job of its own script is held to the same dir when its job file names one; one that
names none (`lazarus run`'s) has its claims taken as they are, and retention keeps the record
its rounds restored from, so forged claims cannot push that out.
A claim never replaces the record of its step, unless the daemon reads another manifest there
than the one the record was adopted with (the trainer saved the step again, after a rollback):
so no agent can mark a record good again, move it elsewhere or lose it. Each claim is deleted
once judged; one that is not adopted with a `checkpoint_claim_refused` event saying why.

Records are checked again before a round restores one (`why_not`: records of an older version
were the agents' to write); one that fails is skipped with a `checkpoint_refused` event.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from lazarus.core.jobfile import JobFileError, read_job_file
from lazarus.core.jobspec import JobSpec
from lazarus.core.records import CheckpointRecord
from lazarus.daemon.actions import AdoptClaim, Decision, DropClaim, DropClaimsBelow, Emit
from lazarus.daemon.view import ClusterView

# The trainer's names (lazarus.trainer.checkpoint, which needs torch: not imported here).
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")
# A manifest lists one line per file of every rank; far below this.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
# Longer paths are no directory (PATH_MAX), and would swell the leader's transactions.
MAX_PATH = 4096
# What of an agent's claim goes into an event.
_SHOWN = 256
# The storage is read beside the decision pass, not in it (paths resolved, the manifest
# read): a mount that hangs (NFS, or a FUSE file system a rank mounted in its checkpoint dir)
# would freeze the leader's pass for as long. A pass waits this long for a check; one not
# answered by then is "not verified yet" -- a claim waits for a later pass, a record is not
# restored in this one -- and goes on in its thread, whose answer the next pass that asks
# takes. Once a check has hung that long, new ones are not waited for; past MAX_HUNG_READS
# hung at once, none is even started.
READ_WAIT_S = 2.0
MAX_HUNG_READS = 4


@dataclass(frozen=True, slots=True)
class Verdict:
    why: str | None           # None: it may be restored
    manifest_sha256: str = ""  # of the manifest the check read ("" where it read none)
    answered: bool = True      # False: the storage has not answered yet (`why` says so)


_Manifest = tuple[dict, str]  # the manifest and its sha256


def checkpoint_dir(job: JobSpec) -> str | None:
    """The job's checkpoint dir as the ranks see it (relative to the job's cwd), or None."""
    ck = job.train.get("checkpoint") if isinstance(job.train, dict) else None
    d = ck.get("dir") if isinstance(ck, dict) else None
    if not isinstance(d, str) or not d:
        return None
    return os.path.join(job.cwd, d) if job.cwd and not os.path.isabs(d) else d


def _read_manifest(path: str) -> _Manifest | str | None:
    """The manifest in `path` with its sha256; None when the daemon cannot see the checkpoint
    dir at all; a reason when it sees it and the manifest is missing or unreadable."""
    if not os.path.isdir(os.path.dirname(path)):
        return None
    try:  # the job's ranks write that dir: no FIFO, symlink or sparse giant is read
        raw = read_job_file(os.path.join(path, MANIFEST), MAX_MANIFEST_BYTES)
    except JobFileError as e:
        return f"its manifest {e.what}"
    except OSError as e:
        return f"its manifest is unreadable ({e.strerror})"
    try:
        doc = json.loads(raw)
    except ValueError:
        return "its manifest is not JSON"
    if not isinstance(doc, dict):
        return "its manifest is not a JSON object"
    return doc, hashlib.sha256(raw).hexdigest()


class _Beside:
    """Checks that touch the storage, each in a thread of its own; see READ_WAIT_S."""

    def __init__(self, *, wait_s: float = READ_WAIT_S, most: int = MAX_HUNG_READS):
        self._wait_s, self._most = wait_s, most
        self._lock = threading.Lock()
        self._checks: dict[tuple, tuple[Future, float]] = {}  # key -> (its check, started at)

    def __call__(self, key: tuple, check: Callable[[], Verdict]) -> Verdict:
        now = time.monotonic()
        with self._lock:
            running, _ = self._checks.get(key, (None, now))
            wait = 0.0
            if running is None:
                hung = [t for f, t in self._checks.values() if not f.done()]
                if len(hung) >= self._most:
                    return Verdict(f"not verified yet: {len(hung)} reads of the storage are "
                                   "not answered", answered=False)
                # answers nobody came back for: checked again when asked
                self._checks = {k: c for k, c in self._checks.items() if not c[0].done()}
                running = Future()
                self._checks[key] = (running, now)
                threading.Thread(target=self._run, args=(running, check), daemon=True,
                                 name="ckptcheck").start()
                wait = self._wait_s if all(now - t < self._wait_s for t in hung) else 0.0
        try:
            verdict = running.result(wait)
        except TimeoutError:
            return Verdict(f"not verified yet: the storage has not answered in "
                           f"{self._wait_s:g} s", answered=False)
        with self._lock:
            if self._checks.get(key, (None,))[0] is running:
                del self._checks[key]
        return verdict

    @staticmethod
    def _run(running: Future, check: Callable[[], Verdict]) -> None:
        try:
            running.set_result(check())
        except BaseException as e:  # noqa: BLE001 -- raised again in the pass that asks
            running.set_exception(e)


_BESIDE = _Beside()


# Verdicts on records already checked against the storage. A record is adopted once its
# step's manifest is durable and rewritten (a new committed_at) when the step is saved again,
# so its verdict holds: the decision passes and retention that ask again and again read no
# manifest twice. Bounded: the oldest go first.
_VERDICTS: OrderedDict[tuple, Verdict] = OrderedDict()
MAX_VERDICTS = 4096


def why_not(rec: CheckpointRecord, job: JobSpec,
            read_manifest: Callable[[str], _Manifest | str | None] = _read_manifest
            ) -> str | None:
    """Why `rec` must not be restored for `job`; None when it may."""
    return check(rec, job, read_manifest).why


def check(rec: CheckpointRecord, job: JobSpec,
          read_manifest: Callable[[str], _Manifest | str | None] = _read_manifest, *,
          fresh: bool = False) -> Verdict:
    """The verdict on `rec` for `job`; `fresh`: read the storage again whatever is cached
    (for a claim, whose committed_at an agent chose: an old one must not bring back the
    manifest a step had before it was saved again)."""
    if read_manifest is not _read_manifest:
        return _check(rec, job, read_manifest)
    key = (job.id, job.cwd, checkpoint_dir(job), rec.path, rec.step, rec.committed_at)
    if key in _VERDICTS and not fresh:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]
    _VERDICTS.pop(key, None)
    verdict = _BESIDE(key, lambda: _check(rec, job, read_manifest))
    if not verdict.answered:
        return verdict  # asked again next time
    _VERDICTS[key] = verdict
    while len(_VERDICTS) > MAX_VERDICTS:
        _VERDICTS.popitem(last=False)
    return verdict


def _check(rec: CheckpointRecord, job: JobSpec,
           read_manifest: Callable[[str], _Manifest | str | None]) -> Verdict:
    root = checkpoint_dir(job)
    if root is None:
        # A job of its own script that names no dir (`lazarus run` names none): nothing to
        # hold its claims to; retention keeps the record its rounds restored from
        # (docs/security.md, "The job's own code", says what is left open).
        return Verdict(None)
    if not rec.path or "\0" in rec.path:
        return Verdict("its path is empty")
    if len(rec.path) > MAX_PATH:
        return Verdict(f"its path is longer than {MAX_PATH} characters")
    shown = repr(rec.path[:_SHOWN])
    path = rec.path if os.path.isabs(rec.path) or not job.cwd else os.path.join(job.cwd, rec.path)
    if ".." in path.split(os.sep):
        return Verdict(f"its path {shown} has '..' in it")
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.dirname(real) != real_root:
        return Verdict(f"its path {shown} is not a directory of the job's checkpoint dir {root}")
    m = _STEP_DIR.fullmatch(os.path.basename(real))
    if m is None or int(m.group(1)) != rec.step:
        return Verdict(f"its path {shown} is not the directory of step {rec.step}")
    read = read_manifest(real)
    if read is None:
        return Verdict(None)  # the daemon does not see the storage: the path checks are all
    if isinstance(read, str):
        return Verdict(read)
    manifest, digest = read
    if manifest.get("job_id") != job.id:
        return Verdict(f"its manifest is job {str(manifest.get('job_id'))[:64]!r}'s, not "
                       f"{job.id!r}'s")
    step = manifest.get("step")
    if isinstance(step, bool) or step != rec.step:
        return Verdict(f"its manifest is of step {str(step)[:32]}, not {rec.step}")
    return Verdict(None, digest)


def adopt_claims(view: ClusterView) -> tuple[Decision | None, ClusterView]:
    """The leader's answer to the checkpoint claims of `view`, and the view as it is once that
    answer is applied (the adopted claims among its records): the rest of the pass decides
    from that one, so a round started in the same pass restores the newest checkpoint. While
    the run or its job is unreadable, readable claims wait (as many as a view holds: older
    ones are deleted all the same)."""
    if not view.claims:
        return None, view
    actions: list = []
    said: list[str] = []
    if view.older_claims:
        msg = (f"{view.older_claims} older checkpoint claim(s) deleted unread: a pass looks at "
               f"the newest {len(view.claims)}")
        actions += [DropClaimsBelow(view.claims[0].key),
                    Emit("checkpoint_claims_dropped", msg, {"count": view.older_claims})]
        said.append(msg)
    st, job = view.status, view.job
    run_job = job if st is not None and job is not None and job.id == st.job_id else None
    records = {c.step: c for c in view.checkpoints}
    revisions: dict[int, int] = {}
    superseded = 0
    newest = None  # the newest step adopted so far (claims come newest last: by key)
    for claim in reversed(view.claims):
        if claim.record is None:
            why, rec = claim.problem, None
        elif run_job is None:
            continue
        else:
            why, rec = judge(claim.record, run_job, records.get(claim.record.step))
            if why is None:
                continue  # the storage has not answered: the claim waits for a later pass
        name = claim.key.rpartition("/")[2][:_SHOWN]
        if rec is None and newest is not None and claim.record is not None \
                and claim.record.step < newest:
            # Claims that waited for a leader (a daemon failover) while the trainer's own
            # retention removed their directories: a newer one is recorded, nothing is lost.
            actions.append(DropClaim(claim.key))
            superseded += 1
        elif rec is None:
            msg = f"checkpoint claim {name} refused: {why[:4 * _SHOWN]}"
            fields = {"key": name, "reason": why[:4 * _SHOWN]}
            if claim.record is not None:
                fields |= {"step": claim.record.step, "path": claim.record.path[:_SHOWN]}
            actions += [DropClaim(claim.key), Emit("checkpoint_claim_refused", msg, fields)]
            said.append(msg)
        else:
            actions.append(AdoptClaim(claim.key, rec))
            records[rec.step], revisions[rec.step] = rec, claim.mod_revision
            said.append(f"checkpoint step {rec.step} recorded")
            newest = rec.step if newest is None else max(newest, rec.step)
    if superseded:
        said.append(f"{superseded} older claim(s) that no longer check dropped")
    if not actions:
        return None, view
    adopted = dataclasses.replace(
        view, checkpoints=sorted(records.values(), key=lambda c: c.step),
        checkpoint_revision={**view.checkpoint_revision, **revisions})
    return Decision(actions, "; ".join(said)), adopted


def judge(claim: CheckpointRecord, job: JobSpec,
          record: CheckpointRecord | None) -> tuple[str | None, CheckpointRecord | None]:
    """(why not, None), or ("", the record to write) for a claim of `job`'s run, where
    `record` is its step's record now; (None, None) while the storage has not answered."""
    if claim.job_id != job.id:
        return f"it is job {claim.job_id[:64]!r}'s, not the run's ({job.id!r})", None
    verdict = check(claim, job, fresh=True)
    if not verdict.answered:
        return None, None
    if verdict.why is not None:
        return verdict.why, None
    if record is not None and not (verdict.manifest_sha256 and record.manifest_sha256
                                   and verdict.manifest_sha256 != record.manifest_sha256):
        how = ("the same save" if verdict.manifest_sha256 == record.manifest_sha256 != ""
               else "the daemon cannot tell a new save from the one recorded")
        return f"step {claim.step} has a record already ({how})", None
    return "", CheckpointRecord(step=claim.step, path=claim.path, round=claim.round,
                                job_id=job.id, committed_at=claim.committed_at, good=True,
                                manifest_sha256=verdict.manifest_sha256)
