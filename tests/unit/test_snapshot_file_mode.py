"""A rank's tier-0 snapshot file holds its weights and optimizer state: it is 0600 from its
first byte (whatever the umask), and the temporary it is written under is a new file, never
one planted in its place (a symlink at the name a rank used to write to)."""

from __future__ import annotations

import os
import stat

import pytest

from lazarus.trainer import snapshot


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_snapshot_and_its_temporary_are_0600(tmp_path, loose_umask, monkeypatch):
    modes = []
    replace = os.replace

    def watching(src, dst):
        modes.append(stat.S_IMODE(os.lstat(src).st_mode))
        replace(src, dst)
    monkeypatch.setattr(snapshot.os, "replace", watching)
    written = []
    snapshot.write_file(tmp_path, 3, 17, (b"head", b"body"),
                        lambda step, path: written.append((step, path)))
    (step, path), = written
    assert step == 17 and open(path, "rb").read() == b"headbody"
    assert modes == [0o600]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == [os.path.basename(path)]


def test_a_symlink_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    final = tmp_path / "r00003-s0000000017.t0"
    (tmp_path / f"{final.name}.{os.getpid()}.tmp").symlink_to(victim)
    snapshot.write_file(tmp_path, 3, 17, (b"x" * 10,), lambda step, path: None)
    assert victim.read_bytes() == b"precious"
    assert final.read_bytes() == b"x" * 10 and not final.is_symlink()


def test_a_failed_write_leaves_no_temporary(tmp_path):
    # what a full tmpfs does halfway through the second part
    with pytest.raises(TypeError):
        snapshot.write_file(tmp_path, 0, 1, (b"ok", object()), lambda step, path: None)
    assert os.listdir(tmp_path) == []
