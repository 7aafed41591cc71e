"""A token file whose token is short enough to guess (a placeholder left in place) is refused
where it is read, for the daemon (--token-file, --read-token-file) and the CLI alike, with one
line naming the file; a token of MIN_TOKEN_CHARS is taken."""

from __future__ import annotations

import pytest

from lazarus.cli import main as cli_main
from lazarus.core import endpoint_file
from lazarus.core.errors import UserError


@pytest.mark.parametrize("text", ["t0ken", "x" * (endpoint_file.MIN_TOKEN_CHARS - 1),
                                  "  short-token \n"])
def test_a_short_token_file_is_refused_naming_the_file(tmp_path, text):
    path = tmp_path / "api-token"
    path.write_text(text)
    path.chmod(0o600)  # a file others may read is refused first (test_token_file_mode.py)
    with pytest.raises(UserError) as e:
        endpoint_file.load_token(path)
    assert str(path) in str(e.value) and f"at least {endpoint_file.MIN_TOKEN_CHARS}" in str(e.value)


def test_a_token_of_the_minimum_length_is_taken(tmp_path):
    path = tmp_path / "api-token"
    path.write_text("k" * endpoint_file.MIN_TOKEN_CHARS + "\n")
    path.chmod(0o600)  # a file others may read is refused first (test_token_file_mode.py)
    assert endpoint_file.load_token(path) == "k" * endpoint_file.MIN_TOKEN_CHARS


def test_the_cli_refuses_a_short_token_file_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LAZARUS_HOME", str(tmp_path))
    path = tmp_path / "token"
    path.write_text("t0ken\n")
    path.chmod(0o600)  # a file others may read is refused first (test_token_file_mode.py)
    assert cli_main(["status", "--address", "127.0.0.1:1", "--token-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(path) in err and "5 characters" in err, err
