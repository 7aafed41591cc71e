"""Every secret file is refused, as the API token file is (tests/unit/test_token_file_mode.py),
when it is the user's own and group or others may read it: etcd's password
(--etcd-password-file) and the tier-0 replica key (--replica-key-file), the same one-line
error naming the file and `chmod 600` (lazarus.core.privatedir.read_secret_file). What the
shipped deployments hand over is taken: a 0600 or 0400 file, and a file of another owner's
(systemd's credential, a Kubernetes Secret under fsGroup)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lazarus.core.errors import UserError
from lazarus.core.etcd_auth import EtcdAuth
from tests.unit.test_tier0_private import agent_options

PASSWORD = "p" * 24
KEY = "0123456789abcdef" * 4


def _file(path, text: str, mode: int):
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def _password(path):
    return EtcdAuth.load(user="lazarus-agent", password_file=str(path), env={}).password


def _replica_key(path, tmp_path, monkeypatch):
    return agent_options(tmp_path, monkeypatch, replica_key_file=str(path)).key


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_password_file_others_may_read_is_refused(tmp_path, mode):
    path = _file(tmp_path / "lazarus-agent.password", PASSWORD, mode)
    with pytest.raises(UserError) as e:
        _password(path)
    message = str(e.value)
    assert message.startswith(f"--etcd-password-file {str(path)!r} may be read by other users")
    assert f"mode {mode:04o}" in message and f"chmod 600 {path}" in message
    assert "\n" not in message


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_replica_key_file_others_may_read_is_refused(tmp_path, monkeypatch, mode):
    path = _file(tmp_path / "replica-key", KEY, mode)
    with pytest.raises(UserError) as e:
        _replica_key(path, tmp_path, monkeypatch)
    message = str(e.value)
    assert message.startswith(f"--replica-key-file file {str(path)!r} may be read by other")
    assert f"mode {mode:04o}" in message and f"chmod 600 {path}" in message
    assert "\n" not in message


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_private_secret_files_are_taken(tmp_path, monkeypatch, mode):
    assert _password(_file(tmp_path / "pw", PASSWORD, mode)) == PASSWORD
    assert _replica_key(_file(tmp_path / "key", KEY, mode), tmp_path, monkeypatch) == KEY.encode()


def test_a_kubernetes_secret_symlink_is_judged_by_the_file_it_names(tmp_path, monkeypatch):
    """The agent's replica-key volume: key -> ..data/key -> ..2024_01_01/key, 0400."""
    (tmp_path / "..2024_01_01").mkdir()
    real = _file(tmp_path / "..2024_01_01" / "key", KEY, 0o400)
    (tmp_path / "..data").symlink_to("..2024_01_01")
    (tmp_path / "key").symlink_to("..data/key")
    assert _replica_key(tmp_path / "key", tmp_path, monkeypatch) == KEY.encode()
    real.chmod(0o644)
    with pytest.raises(UserError, match="mode 0644"):
        _replica_key(tmp_path / "key", tmp_path, monkeypatch)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root")
def test_files_of_another_owner_are_taken_whatever_their_mode(tmp_path, monkeypatch):
    """systemd's credential for a User= service: root's, with a read ACL (mode 0440)."""
    password = _file(tmp_path / "pw", PASSWORD, 0o440)
    key = _file(tmp_path / "key", KEY, 0o440)
    for path in (password, key):
        os.chown(path, 65534, -1)
    assert _password(password) == PASSWORD
    assert _replica_key(key, tmp_path, monkeypatch) == KEY.encode()


def test_the_agent_refuses_a_readable_password_file_in_one_line(tmp_path):
    path = _file(tmp_path / "pw", PASSWORD, 0o644)
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "agent", "--etcd",
                           "127.0.0.1:1", "--node", "n0", "--nproc", "1", "--workdir",
                           str(tmp_path / "work"), "--etcd-user", "lazarus-agent",
                           "--etcd-password-file", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and f"chmod 600 {path}" in proc.stderr, proc.stderr
