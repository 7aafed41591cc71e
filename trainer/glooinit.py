"""gloo process groups made on use (docs/scale.md, "What a survivor pays, in counts").

A gloo group made eagerly connects every pair of its ranks when it is made: a full mesh,
N - 1 connections a rank and N(N - 1) address reads from the store in all, paid again by
every rank, survivors included, in every recovery. Made on use (torch's
TORCH_GLOO_LAZY_INIT, read each time a group is made) a rank only publishes its own address
then; a pair connects at the first collective that uses it, reading its peer's address from
the group's store at that moment. A group then holds the connections its collectives use (a
ring's neighbours, a gather's root, a barrier's log2 N partners), not a full mesh.

The price: the group's store must still answer at the round's first collectives. The
built-in trainer's store is its agent's long-lived one (lazarus.trainer.worker), so it does.
A pair whose peer died before it connected fails at once ("Connection refused", after
gloo's three retries), which the rank reads as a lost peer like any other
(lazarus.trainer.peerloss).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


def on_use() -> None:
    """Make this process's gloo groups on use from here on, unless the operator set
    $TORCH_GLOO_LAZY_INIT (to either value) in the rank's environment."""
    os.environ.setdefault(LAZY_ENV, "1")


@contextmanager
def made_on_use() -> Iterator[None]:
    """The gloo groups made inside are made on use (the operator's own setting wins); the
    process's setting is as before afterwards."""
    if LAZY_ENV in os.environ:
        yield
        return
    os.environ[LAZY_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_ENV, None)
