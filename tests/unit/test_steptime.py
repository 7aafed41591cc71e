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


def test_a_background_writer_thread_is_not_the_steps_compute():
    """A checkpoint written by a background thread (rank 0 writes the most of it) burns CPU
    during the next steps; it is not the rank's step work, or healthy rank 0 looks slow."""
    import threading

    clock = ComputeClock(torch.device("cpu"))
    stop = threading.Event()
    writer = threading.Thread(target=lambda: [_spin(0.01) for _ in iter(stop.is_set, True)],
                              name="lazarus-ckpt_0")
    writer.start()
    try:
        clock.start()
        time.sleep(0.3)                  # waiting in a collective while the writer works
        waited = clock.stop()
    finally:
        stop.set()
        writer.join()
    assert waited < 0.05
    # torch's own intra-op threads are native, not Python threads: a matmul counts in full
    clock.start()
    a = torch.ones(512, 512)
    for _ in range(20):
        a = a @ torch.ones(512, 512) / 512
    assert clock.stop() > 0
