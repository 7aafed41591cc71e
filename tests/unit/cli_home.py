"""The operator CLI's surroundings, fresh for each test of a module that imports the fixture:
its home (where the endpoint file is looked for) a test's own directory, and no daemon
address or token from the environment of whoever runs the tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def lazarus_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZARUS_HOME", str(tmp_path))
    for var in ("LAZARUS_ADDRESS", "LAZARUS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path
