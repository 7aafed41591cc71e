"""Suite-wide: keep what the CLI and `lazarus up` leave for the operator (the endpoint file)
out of the real home directory."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _lazarus_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("lazarus-home")
    old = os.environ.get("LAZARUS_HOME")
    os.environ["LAZARUS_HOME"] = str(home)  # inherited by every process a test starts
    yield home
    if old is None:
        os.environ.pop("LAZARUS_HOME", None)
    else:
        os.environ["LAZARUS_HOME"] = old
