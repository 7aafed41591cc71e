"""A token file of one's own that group or others may read is refused, as ssh refuses such a
private key, in one line naming the file and `chmod 600`; for the CLI and the daemon alike.
What the shipped deployments hand over is taken: a 0600 file, systemd's LoadCredential= file
(0400, or root's with a read ACL), and a Kubernetes Secret's file (a symlink into the volume,
root's and group-readable under fsGroup)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lazarus.cli import main as cli_main
from lazarus.core import endpoint_file
from lazarus.core.errors import UserError

TOKEN = "k" * 32


def _token_file(path, mode: int):
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_a_token_file_others_may_read_is_refused(tmp_path, mode):
    path = _token_file(tmp_path / "token", mode)
    with pytest.raises(UserError) as e:
        endpoint_file.load_token(path)
    message = str(e.value)
    assert str(path) in message and f"mode {mode:04o}" in message
    assert f"chmod 600 {path}" in message and "\n" not in message


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_private_token_file_is_taken(tmp_path, mode):
    assert endpoint_file.load_token(_token_file(tmp_path / "token", mode)) == TOKEN


def test_a_symlink_is_judged_by_the_file_it_names(tmp_path):
    """A Kubernetes Secret's file: token -> ..data/token -> ..2024_01_01/token."""
    (tmp_path / "..2024_01_01").mkdir()
    _token_file(tmp_path / "..2024_01_01" / "token", 0o600)
    (tmp_path / "..data").symlink_to("..2024_01_01")
    (tmp_path / "token").symlink_to("..data/token")
    assert endpoint_file.load_token(tmp_path / "token") == TOKEN
    (tmp_path / "..2024_01_01" / "token").chmod(0o644)
    with pytest.raises(UserError, match="mode 0644"):
        endpoint_file.load_token(tmp_path / "token")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root")
def test_a_file_of_another_owner_is_taken_whatever_its_mode(tmp_path):
    """As ssh does: a Secret under fsGroup (root's, 0440) or systemd's credential (root's, a
    read ACL) reaches the daemon's user through a group or an ACL; its mode is not its own."""
    path = _token_file(tmp_path / "token", 0o644)
    os.chown(path, 65534, -1)
    assert endpoint_file.load_token(path) == TOKEN


def test_the_cli_refuses_it_in_one_line(tmp_path, capsys):
    path = _token_file(tmp_path / "token", 0o644)
    assert cli_main(["status", "--address", "127.0.0.1:1", "--token-file", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"chmod 600 {path}" in err


def test_the_daemon_refuses_it_in_one_line(tmp_path):
    path = _token_file(tmp_path / "token", 0o644)
    proc = subprocess.run([sys.executable, "-m", "lazarus.cli", "daemon", "--etcd",
                           "127.0.0.1:1", "--read-token-file", str(path), "--endpoint-file",
                           str(tmp_path / "endpoint.json")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LAZARUS_TOKEN": "a" * 32})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"chmod 600 {path}" in proc.stderr, proc.stderr
