"""What one rank's process carries from one round to the next (docs/inplace.md).

A rank that survives a lost peer stays for the next round in its process
(lazarus.trainer.inplace): the round it runs now, the round whose groups its agent said to
abort (the session's reader thread hears that), and the model and optimizer the built-in
trainer keeps for a next round of the same shape (lazarus.trainer.kept) live here, in the one
object of the process. `worker.run` hands it to the trainer's round; the agent's word and a
script's `lazarus.trainer.run` reach it through `this_process()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazarus.trainer.kept import Held


@dataclass(eq=False)
class RankProcess:
    round: int | None = None    # the round this process runs; None: its first, as started
    told: int | None = None     # the round whose groups its agent said to abort
    collected: bool = False     # the last round's objects were freed while it waited
    held: Held | None = None    # the built-in trainer's model and optimizer, kept
    # Wall-clock times of a survivor's hand-over (its start line splits it: docs/scale.md):
    # when it saw a peer of its last round gone, when it had let that round go, and when the
    # next round's assignment reached it.
    noticed_at: float = 0.0
    left_at: float = 0.0
    resumed_at: float = 0.0

    def was_told(self) -> bool:
        """Whether the agent said a peer of this process's round is gone."""
        return self.told is not None and self.round in (None, self.told)


_THIS = RankProcess()


def this_process() -> RankProcess:
    return _THIS
