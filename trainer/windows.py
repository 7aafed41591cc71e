"""What happens to each data window: left out (`skip_windows`) or faulted (`inject`).

A data window is the span of sequence cursors one optimizer step reads, as
`SequenceLoader.position()` gives it: ``{"first": f, "last": l}``, inclusive. Every decision here
is keyed on cursors, never on step numbers, so it means the same after a restart, a rollback,
a reshard or a skipped batch.

skip_windows
    ``[[first, last], ...]``: a window that overlaps one of these is never read. The loader
    moves past it and the step is trained on the next window, so leaving data out costs no
    optimizer step and no place in the learning-rate schedule.

inject (fault injection for tests and `lazarus up --chaos`; reproducible and restart-proof)
    ``"loss-spike@STEP"``: the window step STEP reads in an uninterrupted run without skips is
        poisoned: each of its sequences is replaced by one garbage token repeated (ids from
        the upper half of the vocabulary, which byte-level source text never uses), a real
        batch with a real loss and gradient spike. Skip that window and the poison is gone.
    ``"diverge@STEP"``: the same poison over the DIVERGE_STEPS consecutive windows steps
        STEP, STEP+1, ... read in such a run (one span of cursors): the guard fires on each of
        them, the repetition the daemon answers with a rollback, and once a rollback skips
        the span the run is back on its normal course.
"""

from __future__ import annotations

import re

import torch

from lazarus.core.errors import UserError
from lazarus.trainer.data import SequenceLoader

INJECT_KINDS = ("loss-spike", "diverge")
# Poisoned steps of a divergence: more than the daemon's default of 3 spikes for a rollback.
DIVERGE_STEPS = 5
_INJECT_RE = re.compile(r"(?P<kind>[a-z-]+)@(?P<step>\d+)")


def parse_injection(spec: str) -> tuple[str, int]:
    """("loss-spike" | "diverge", step >= 1) from "KIND@STEP"; UserError otherwise."""
    m = _INJECT_RE.fullmatch(spec)
    if m is None or m["kind"] not in INJECT_KINDS or int(m["step"]) < 1:
        raise UserError(f"inject {spec!r} must be KIND@STEP with KIND one of "
                        f"{', '.join(INJECT_KINDS)} and STEP >= 1")
    return m["kind"], int(m["step"])


def check_skip_window(index: int, window) -> None:
    if not (len(window) == 2 and 0 <= window[0] <= window[1]):
        raise UserError(f"skip_windows[{index}] must be [first, last] with 0 <= first <= last, got {window}")


def overlaps(window: dict, span: list[int] | tuple[int, int]) -> bool:
    return window["first"] <= span[1] and span[0] <= window["last"]


class DataWindows:
    """The skip list and the injected faults of one run, applied to `loader`'s windows."""

    def __init__(self, loader: SequenceLoader, *, skip: list[list[int]], inject: list[str],
                 vocab_size: int):
        self.loader = loader
        self.skip = [tuple(w) for w in skip]
        self.vocab_size = vocab_size
        self.poisoned: list[tuple[int, int]] = []
        for spec in inject:
            kind, step = parse_injection(spec)
            last_step = step + (DIVERGE_STEPS - 1 if kind == "diverge" else 0)
            self.poisoned.append((window_of_step(loader, step)[0], window_of_step(loader, last_step)[1]))

    def next_window(self) -> tuple[dict, list[dict]]:
        """Move the loader past skipped windows: (the window the next step reads, those left out)."""
        left_out = []
        window = self.loader.position()
        while any(overlaps(window, span) for span in self.skip):
            left_out.append(window)
            self.loader.skip(1)
            window = self.loader.position()
        return window, left_out

    def poison(self, window: dict, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches, or garbage of the same shape if the window is poisoned."""
        if not any(overlaps(window, span) for span in self.poisoned):
            return micro_batches
        # The garbage is a function of the window alone, cut like the loader cuts real data, so
        # it is the same batch whatever the mesh.
        gen = torch.Generator().manual_seed(window["first"])
        seq_len = micro_batches[0][0].shape[1]
        garbage = torch.randint(self.vocab_size // 2, self.vocab_size,
                                (self.loader.global_batch, 1), generator=gen).expand(-1, seq_len + 1)
        mine = garbage.chunk(self.loader.dp_size)[self.loader.dp_rank].split(self.loader.micro_batch)
        return [(rows[:, :-1], rows[:, 1:]) for rows in mine]


def window_of_step(loader: SequenceLoader, step: int) -> tuple[int, int]:
    """(first, last) cursor of the window `step` reads in an uninterrupted run without skips."""
    fresh = SequenceLoader(loader.dataset, seed=loader.seed, global_batch=loader.global_batch,
                           dp_rank=0, dp_size=1, micro_batch=loader.global_batch)
    fresh.skip(step - 1)
    pos = fresh.position()
    return pos["first"], pos["last"]
