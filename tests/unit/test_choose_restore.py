"""Where a rank's state for a round comes from (lazarus.trainer.train.choose_restore), as a
table: the cheapest source that holds the round's step wins."""

from __future__ import annotations

import pytest

from lazarus.trainer.train import (CAPTURED, CHECKPOINT, KEPT, SCRATCH, SNAPSHOT,
                                   choose_restore)

SNAP, CKPT = "/agent/tier0/job-r1-s12.snap", "/ckpt/step-10"


@pytest.mark.parametrize("restore_step, snapshot, checkpoint, kept_step, captured_step, how, source", [
    # the first round: nothing to restore, whatever the process holds
    (0, None, None, 0, None, SCRATCH, "scratch"),
    (0, None, None, 12, 12, SCRATCH, "scratch"),
    # a new process: the round's copy, memory before storage
    (12, SNAP, None, 0, None, SNAPSHOT, "memory"),
    (10, None, CKPT, 0, None, CHECKPOINT, "storage"),
    # a survivor whose objects hold the very step: nothing to load
    (12, SNAP, None, 12, 12, KEPT, "kept"),
    (10, None, CKPT, 10, None, KEPT, "kept"),
    # ... one step ahead of it (it finished a step the others did not): its last snapshot of
    # that step, still in its buffers, rather than the file
    (12, SNAP, None, 13, 12, CAPTURED, "memory"),
    (12, None, CKPT, 13, 12, CAPTURED, "memory"),
    # ... its buffers hold another step: the round's copy
    (12, SNAP, None, 13, 11, SNAPSHOT, "memory"),
    (10, None, CKPT, 13, 12, CHECKPOINT, "storage"),
    # a step 0 kept (nothing trained yet) is no step to go on from
    (0, None, CKPT, 0, None, CHECKPOINT, "storage"),
])
def test_the_cheapest_source_that_holds_the_step(restore_step, snapshot, checkpoint, kept_step,
                                                 captured_step, how, source):
    plan = choose_restore(restore_step=restore_step, snapshot=snapshot, checkpoint=checkpoint,
                          kept_step=kept_step, captured_step=captured_step)
    assert (plan.how, plan.source) == (how, source)
