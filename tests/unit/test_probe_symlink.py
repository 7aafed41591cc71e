"""The storage probes write into the job's checkpoint dir, which other users may write to (a
shared filesystem): a symlink one of them plants where a probe would write must not be
written through (lazarus.agent.host's probe, lazarus.agent.preflight.storage). The attacker
is uid 65534 (nobody); the agent may run as root, as these tests do."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from lazarus.agent import host as H
from lazarus.agent import preflight as P

NOBODY = 65534


def shared_dir(tmp_path) -> tuple[Path, Path]:
    """A checkpoint dir anyone may write to (not sticky: the kernel's protected_symlinks
    does not help there), and a file of the agent's user's outside it."""
    d = tmp_path / "checkpoints"
    d.mkdir()
    os.chmod(d, 0o777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    return d, victim


def plant(d: Path, name: str, victim: Path) -> Path:
    link = d / name
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    return link


def test_the_host_probe_writes_through_no_symlink_at_its_old_name(tmp_path):
    d, victim = shared_dir(tmp_path)
    plant(d, f".lazarus-probe-{os.getpid()}", victim)   # the name it used to take
    sample = H.sample_host(H.HostConfig(checkpoint_dir=d))
    assert sample.write_error is None
    assert victim.read_bytes() == b"precious"


def test_the_host_probe_never_opens_a_file_that_was_there(tmp_path, monkeypatch):
    d, victim = shared_dir(tmp_path)
    monkeypatch.setattr(H.secrets, "token_hex", lambda n: "guessed")
    link = plant(d, ".lazarus-probe-guessed", victim)
    sample = H.sample_host(H.HostConfig(checkpoint_dir=d))
    assert sample.write_error.startswith("EEXIST"), sample.write_error
    assert victim.read_bytes() == b"precious" and link.is_symlink()


def test_the_probe_leaves_nothing_behind(tmp_path):
    d, _ = shared_dir(tmp_path)
    assert H.sample_host(H.HostConfig(checkpoint_dir=d)).write_error is None
    assert P.storage([d], 1 << 16)[0]
    assert list(d.iterdir()) == []


def test_preflights_storage_check_writes_through_no_symlink_at_its_old_name(tmp_path):
    d, victim = shared_dir(tmp_path)
    plant(d, f".lazarus-preflight-{os.getpid()}-{threading.get_ident()}", victim)
    ok, reason = P.storage([d], 1 << 16)
    assert ok, reason
    assert victim.read_bytes() == b"precious"


def test_preflights_storage_check_never_opens_a_file_that_was_there(tmp_path, monkeypatch):
    d, victim = shared_dir(tmp_path)
    monkeypatch.setattr(P.secrets, "token_hex", lambda n: "guessed")
    plant(d, ".lazarus-preflight-guessed", victim)
    ok, reason = P.storage([d], 1 << 16)
    assert not ok and "File exists" in reason, reason
    assert victim.read_bytes() == b"precious"
