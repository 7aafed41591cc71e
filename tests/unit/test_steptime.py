"""A rank's own compute time: waiting (as in a collective) does not count, working does, and
the slow-node fault makes the work take `factor` times as long."""

import json
import time

import torch

from lazarus.trainer.steptime import ComputeClock, Slowdown


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


def test_slowdown_multiplies_the_work_of_a_step(tmp_path):
    script = tmp_path / "n1.slowdown.json"
    slow, clock = Slowdown(str(script)), ComputeClock(torch.device("cpu"))
    script.write_text(json.dumps({"factor": 3}))
    assert slow.refresh() == 3.0
    clock.start()
    _spin(0.05)
    slow.apply(clock)
    assert clock.stop() >= 0.15
    script.write_text("{half written")   # read again next step, full speed meanwhile
    assert slow.refresh() == 1.0
