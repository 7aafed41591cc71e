"""What a job's ranks leave in their checkpoint dir cannot stall or fool the leader's check
(lazarus.daemon.ckptcheck through lazarus.core.jobfile; docs/security.md, "The job's own
code"): a FIFO, a symlink or a sparse giant at a manifest's path is refused with a reason, and
a storage that does not answer leaves the pass going, the check "not verified yet"."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from lazarus.core.jobfile import JobFileError, read_job_file
from lazarus.daemon import ckptcheck
from lazarus.daemon.actions import AdoptClaim
from tests.unit.test_ckpt_claims import _claim, _job, _save, _view, kinds

# A failure detector, not a speed limit: the checks answer in milliseconds, a stuck one never.
STUCK_S = 20.0


def _in_thread(fn):
    """fn() run in a thread; its result, or a failure when it is still stuck after STUCK_S."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(STUCK_S)
    assert not t.is_alive(), "the leader's check is stuck"
    return out[0]


@pytest.fixture
def ckdir(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    return d


@pytest.fixture
def fifo(ckdir):
    """A step dir whose manifest.json is a FIFO nobody writes; an open() stuck on it (the
    check before its mend) is let go at the end."""
    step = ckdir / "step-00000020"
    step.mkdir()
    path = step / "manifest.json"
    os.mkfifo(path)
    yield step
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a stuck reader gets EOF
    except OSError:
        pass  # nobody reads it (ENXIO): nothing stuck


def test_a_fifo_at_the_manifest_is_refused_at_once_naming_it(ckdir, fifo):
    job = _job(ckdir)
    why = _in_thread(lambda: ckptcheck.why_not(_claim(20, fifo).record, job))
    assert why is not None and "manifest is a FIFO" in why, why


def test_a_rank_that_claims_a_fifo_does_not_freeze_the_leader(ckdir, fifo):
    """The issue's attack: a FIFO at manifest.json, then `committed`."""
    d, _ = _in_thread(lambda: ckptcheck.adopt_claims(_view(_job(ckdir),
                                                           claims=[_claim(20, fifo)])))
    assert kinds(d.actions) == ["DropClaim", "Emit:checkpoint_claim_refused"]
    assert "manifest is a FIFO, not a regular file" in d.actions[1].fields["reason"]


@pytest.mark.parametrize("target", ["/etc/passwd", "a manifest of the job elsewhere"])
def test_a_symlink_at_the_manifest_is_not_followed(tmp_path, ckdir, target):
    if target != "/etc/passwd":
        target = str(_save(tmp_path / "elsewhere", 20) / "manifest.json")  # would pass
    step = ckdir / "step-00000020"
    step.mkdir()
    (step / "manifest.json").symlink_to(target)
    why = ckptcheck.why_not(_claim(20, step).record, _job(ckdir))
    assert why is not None and "manifest is a symlink" in why, why


def test_a_sparse_giant_manifest_is_refused_by_its_size(ckdir):
    step = ckdir / "step-00000020"
    step.mkdir()
    with open(step / "manifest.json", "wb") as f:
        f.truncate(100 << 20)  # 100 MB, no block written
    why = ckptcheck.why_not(_claim(20, step).record, _job(ckdir))
    assert why is not None and f"manifest is {100 << 20} bytes, more than" in why, why


def test_a_storage_that_does_not_answer_leaves_the_pass_going(ckdir, monkeypatch):
    """A hung mount (NFS, a rank's FUSE file system): the claim waits and the record is not
    verified yet, pass after pass, each at once; once the storage answers, both go through."""
    path = _save(ckdir, 20)
    answer = threading.Event()
    real = ckptcheck.read_job_file

    def hung(p, cap):
        answer.wait()
        return real(p, cap)

    monkeypatch.setattr(ckptcheck, "read_job_file", hung)
    monkeypatch.setattr(ckptcheck, "_BESIDE", ckptcheck._Beside(wait_s=0.2))
    job, claim = _job(ckdir), _claim(20, path)
    try:
        for _ in range(3):
            d, v = _in_thread(lambda: ckptcheck.adopt_claims(_view(job, claims=[claim])))
            assert d is None and v.checkpoints == []  # neither adopted nor dropped: it waits
            why = _in_thread(lambda: ckptcheck.why_not(claim.record, job))
            assert why is not None and "not verified yet" in why, why
    finally:
        answer.set()
    for _ in range(100):  # the read's thread hands its answer to the next pass that asks
        d, _ = ckptcheck.adopt_claims(_view(job, claims=[claim]))
        if d is not None:
            break
        time.sleep(0.05)
    assert kinds(d.actions) == ["AdoptClaim"] and isinstance(d.actions[0], AdoptClaim)
    assert ckptcheck.why_not(claim.record, job) is None  # not a cached "not verified"


def test_hung_reads_are_bounded(ckdir, monkeypatch):
    """Past MAX_HUNG_READS unanswered, no more reads start: threads do not pile up."""
    answer = threading.Event()
    monkeypatch.setattr(ckptcheck, "read_job_file", lambda p, cap: answer.wait() and b"")
    monkeypatch.setattr(ckptcheck, "_BESIDE", ckptcheck._Beside(wait_s=0.05, most=2))
    job = _job(ckdir)
    try:
        whys = [_in_thread(lambda s=s: ckptcheck.why_not(_claim(s, _save(ckdir, s)).record,
                                                         job)) for s in (1, 2, 3)]
        assert all("not verified yet" in w for w in whys), whys
        assert "2 reads of the storage are not answered" in whys[2], whys
    finally:
        answer.set()


# -- the helper itself -------------------------------------------------------------------------

def test_read_job_file_reads_a_regular_file_whole_up_to_its_cap(tmp_path):
    f = tmp_path / "m.json"
    f.write_bytes(json.dumps({"a": 1}).encode())
    assert read_job_file(f, 100) == b'{"a": 1}'
    with pytest.raises(JobFileError, match="is 8 bytes, more than 7"):
        read_job_file(f, 7)


def test_read_job_file_refuses_a_directory_that_is_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "m.json").write_text("{}")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(JobFileError, match="in a directory that is a symlink"):
        read_job_file(tmp_path / "link" / "m.json", 100)
    with pytest.raises(JobFileError, match="is a directory, not a regular file"):
        read_job_file(real, 100)
    with pytest.raises(FileNotFoundError):
        read_job_file(real / "none.json", 100)
