"""Waiting in the integration tests for something the processes under test do."""

from __future__ import annotations

import time


def until(pred, what: str, *, timeout: float = 20.0, every: float = 0.02):
    """pred()'s first truthy value within `timeout` seconds, polled every `every`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
