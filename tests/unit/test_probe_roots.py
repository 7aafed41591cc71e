"""The agent's storage probes (lazarus.agent.host, lazarus.agent.preflight) write in the job's
checkpoint dir with the agent's rights, which may be more than the job user's (root's under
--run-as): only under the agent's allowed roots, and through no symlink below them, whoever
planted it (docs/security.md, "The job's own code")."""

from __future__ import annotations

import os

import pytest

from lazarus.agent import host as H
from lazarus.agent import preflight as P
from lazarus.agent.gpu import HEALTHY
from lazarus.core import jobpaths


@pytest.fixture
def spaces(tmp_path):
    """(an allowed root, a directory outside it holding a file of the agent's)."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious").write_bytes(b"kept")
    return root, elsewhere


def config(path, root, **kw):
    return H.HostConfig(checkpoint_dir=path, allowed_roots=(str(root),), min_free_bytes=1,
                        low_free_bytes=1, memory_degraded=1.01, memory_failed=1.01, **kw)


def writes(monkeypatch) -> list:
    """Every file the probes create, by the directory descriptor's path."""
    made, real_open = [], os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_CREAT:
            made.append(os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None
                        else os.path.dirname(os.fspath(path)))
        return real_open(path, flags, mode, dir_fd=dir_fd)
    monkeypatch.setattr(os, "open", spy)
    return made


def test_a_checkpoint_dir_outside_the_roots_gets_no_probe(spaces, monkeypatch):
    root, elsewhere = spaces
    made = writes(monkeypatch)
    sample = H.sample_host(config(elsewhere, root))
    assert sample.outside and "outside the directories" in sample.outside
    assert (sample.write_error, sample.free_bytes) == (None, None)
    # not the node's fault: no alert, and no "disappeared" later either
    assert H.assess_host(None, sample, config(elsewhere, root)).state == HEALTHY
    ok, said = P.storage([elsewhere], 1 << 16, allowed_roots=(str(root),))
    assert ok and "skipped (outside the allowed roots)" in said
    assert made == [] and sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_a_symlink_from_inside_the_roots_to_outside_is_not_followed(spaces, monkeypatch):
    root, elsewhere = spaces
    (root / "ck").symlink_to(elsewhere)   # the job user's, in a directory of theirs
    made = writes(monkeypatch)
    assert H.sample_host(config(root / "ck", root)).outside
    assert P.storage([root / "ck"], 1 << 16, allowed_roots=(str(root),))[0]
    assert made == [] and sorted(p.name for p in elsewhere.iterdir()) == ["precious"]


def test_a_component_swapped_for_a_symlink_after_resolving_ends_the_walk(spaces, monkeypatch):
    """The race: the path resolved inside the roots, then the job user put a symlink in the
    way before the probe opened it."""
    root, elsewhere = spaces
    (root / "a").symlink_to(elsewhere)
    (elsewhere / "ck").mkdir()
    monkeypatch.setattr(jobpaths.os.path, "realpath", os.path.abspath)  # resolved before
    with pytest.raises(NotADirectoryError):
        os.close(jobpaths.open_dir(root / "a" / "ck", [str(root)]))
    made = writes(monkeypatch)
    sample = H.sample_host(config(root / "a" / "ck", root))
    assert sample.write_error and "ENOTDIR" in sample.write_error
    ok, said = P.storage([root / "a" / "ck"], 1 << 16, allowed_roots=(str(root),))
    assert not ok and "Not a directory" in said
    assert made == [] and list((elsewhere / "ck").iterdir()) == []


def test_a_symlink_planted_at_the_probes_name_under_a_root_is_not_followed(spaces, monkeypatch):
    root, elsewhere = spaces
    ck = root / "ck"
    ck.mkdir()
    victim = elsewhere / "precious"
    monkeypatch.setattr(H.secrets, "token_hex", lambda n: "guessed")
    monkeypatch.setattr(P.secrets, "token_hex", lambda n: "guessed")
    (ck / ".lazarus-probe-guessed").symlink_to(victim)
    (ck / ".lazarus-preflight-guessed").symlink_to(victim)
    assert H.sample_host(config(ck, root)).write_error.startswith("EEXIST")
    ok, said = P.storage([ck], 1 << 16, allowed_roots=(str(root),))
    assert not ok and "File exists" in said
    assert victim.read_bytes() == b"kept"


def test_under_the_roots_the_probes_write_measure_and_leave_nothing(spaces):
    root, _ = spaces
    ck = root / "job" / "ck"
    ck.mkdir(parents=True)
    sample = H.sample_host(config(ck, root))
    assert sample.write_error is None and sample.free_bytes > 0 and sample.outside is None
    not_yet = H.sample_host(config(root / "job" / "later", root))   # judged by its parent
    assert not_yet.write_error is None and not not_yet.exists and not_yet.free_bytes > 0
    assert P.storage([ck], 1 << 16, allowed_roots=(str(root),))[0]
    assert list(ck.iterdir()) == []


def test_preflight_skips_the_job_dir_outside_the_roots_but_tests_its_own_workdir(spaces):
    root, elsewhere = spaces
    work = root.parent / "work"
    work.mkdir()
    c = P.PreflightConfig(workdir=work, checkpoint_dir=elsewhere, allowed_roots=(str(root),),
                          skip=frozenset({"gpu", "clock", "collective"}))
    checks = {k.name: k for k in P.run_checks(c, gpu_verdicts=lambda: ([], "none"), etcd=None)}
    storage, checkpoint = checks["storage"], checks["checkpoint"]
    assert storage.ok and str(work) in storage.reason and "skipped" in storage.reason
    assert checkpoint.ok and checkpoint.skipped and "outside the allowed roots" in checkpoint.reason
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious"]
