"""The FSDP2 + TP trainer, and the small API a user's own training script adopts
(docs/adopting.md; trainer/examples/plain_fsdp.py is a whole script that does):

    session = lazarus.trainer.connect()
    session.report(step=step, loss=loss, grad_norm=gn, tokens=n, step_time_s=dt)
    if session.should_checkpoint(step, every=100): ...   # agree across ranks, then save
    if session.may_commit(step): ...                      # the fencing check before a commit
    lazarus.trainer.run(main)       # survive a lost peer: main runs again in this process
"""

from lazarus.trainer.inplace import run
from lazarus.trainer.session import Session, connect

# The public API's version (docs/adopting.md): raised when a call changes incompatibly.
API_VERSION = 1

__all__ = ["API_VERSION", "Session", "connect", "run"]
