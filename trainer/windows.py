"""Which data windows a run leaves out (`data.skip_windows`).

A data window is the span of sequence cursors one optimizer step reads, as
`SequenceLoader.position()` gives it: ``{"first": f, "last": l}``, inclusive. Every decision
about data is keyed on cursors, never on step numbers, so it means the same after a restart, a
rollback, a reshard or a skipped batch.

A window that overlaps one of ``skip_windows`` (``[[first, last], ...]``) is never read. The
loader moves past it and the step is trained on the next window, so leaving data out costs no
optimizer step and no place in the learning-rate schedule.
"""

from __future__ import annotations

from lazarus.trainer.data import SequenceLoader


def overlaps(window: dict, span: list[int] | tuple[int, int]) -> bool:
    return window["first"] <= span[1] and span[0] <= window["last"]


class DataWindows:
    """The skip list of one run, applied to `loader`'s windows."""

    def __init__(self, loader: SequenceLoader, *, skip: list[list[int]]):
        self.loader = loader
        self.skip = [tuple(w) for w in skip]

    def next_window(self) -> tuple[dict, list[dict]]:
        """Move the loader past skipped windows: (the window the next step reads, those left out)."""
        left_out = []
        window = self.loader.position()
        while any(overlaps(window, span) for span in self.skip):
            left_out.append(window)
            self.loader.skip(1)
            window = self.loader.position()
        return window, left_out


def window_of_step(loader: SequenceLoader, step: int) -> tuple[int, int]:
    """(first, last) cursor of the window `step` reads in an uninterrupted run without skips."""
    fresh = SequenceLoader(loader.dataset, seed=loader.seed, global_batch=loader.global_batch,
                           dp_rank=0, dp_size=1, micro_batch=loader.global_batch)
    fresh.skip(step - 1)
    pos = fresh.position()
    return pos["first"], pos["last"]
