"""tests/gpu runs only where CUDA is: elsewhere every test here skips with NO_CUDA, which CI
expects (tests/conftest.py). tests/gpu/run.sh runs them on a GPU machine, with the figures."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "needs a CUDA device (tests/gpu/run.sh runs these on a GPU machine)"


def pytest_collection_modifyitems(items):
    if torch.cuda.is_available():
        return
    for item in items:
        if "tests/gpu/" in item.nodeid or item.nodeid.startswith("gpu/"):
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(autouse=True)
def _on_cuda(monkeypatch):
    # The CPU suite keeps its processes on the CPU (tests/conftest.py); these want the GPU.
    monkeypatch.setenv("LAZARUS_DEVICE", "cuda")
