"""The FSDP2 + TP trainer, and the small API a user's own training script adopts:

    session = lazarus.trainer.connect()
    session.report(step, loss, grad_norm, tokens)
    if session.should_checkpoint(step): ...
"""

from lazarus.trainer.session import Session, connect

__all__ = ["Session", "connect"]
