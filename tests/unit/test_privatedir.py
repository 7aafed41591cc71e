"""Private directories (lazarus.core.privatedir): made 0700, and refused when others could
enter or plant things in them."""

import os
import stat

import pytest

from lazarus.core.errors import UserError
from lazarus.core.privatedir import private_dir


def test_a_missing_directory_is_made_private_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        path = private_dir(tmp_path / "a" / "work", "--workdir")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    assert private_dir(path, "--workdir") == path  # an existing private one is fine


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o701])
def test_a_directory_open_to_others_is_refused(tmp_path, mode):
    path = tmp_path / "work"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(UserError, match=f"is open to other users \\(mode {mode:04o}\\)"):
        private_dir(path, "--workdir")


def test_readable_may_be_allowed_but_never_writable(tmp_path):
    path = tmp_path / "home"
    path.mkdir()
    path.chmod(0o755)
    assert private_dir(path, "dir", others_may_read=True) == path
    path.chmod(0o775)
    with pytest.raises(UserError, match="is writable by other users \\(mode 0775\\)"):
        private_dir(path, "dir", others_may_read=True)


def test_a_symlink_or_a_file_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UserError, match="is a symlink"):
        private_dir(tmp_path / "link", "--workdir")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is not a directory"):
        private_dir(tmp_path / "file", "--workdir")


def test_another_users_directory_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "work"
    path.mkdir(mode=0o700)
    owner = os.lstat(path).st_uid
    # As another user would see it: made by someone else first (a shared /tmp).
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(UserError, match=f"belongs to uid {owner}, not to this user"):
        private_dir(path, "--workdir")


def test_a_directory_the_ranks_user_passes_through_is_0710_of_its_group(tmp_path):
    """--run-as: the agent's directories above the ranks' own are given to the ranks' group
    to pass (x), never to list or write; one open to another group is refused."""
    gid = os.getgid()  # a group this process may give a directory to, root or not
    path = private_dir(tmp_path / "work", "--workdir", pass_gid=gid)
    st = os.stat(path)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o710, gid)
    assert private_dir(path, "--workdir", pass_gid=gid) == path  # as it left it: fine
    with pytest.raises(UserError, match="open to"):
        private_dir(path, "--workdir")  # without the ranks' user, it is not private
    os.chmod(path, 0o750)
    with pytest.raises(UserError, match="open to"):
        private_dir(path, "--workdir", pass_gid=gid + 1)
