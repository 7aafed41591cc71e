"""A rank's own compute time: waiting (as in a collective) does not count, working does."""

import time

import torch

from lazarus.trainer.steptime import ComputeClock


def _spin(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_waiting_is_not_compute_but_working_is():
    clock = ComputeClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.3)                      # a peer we wait for in a gloo collective
    waited = clock.stop()
    clock.start()
    _spin(0.1)
    worked = clock.stop()
    assert waited < 0.05 and worked >= 0.1
