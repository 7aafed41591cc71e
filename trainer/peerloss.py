"""Whether an error a rank met says a peer (or the round's store) went away, not that the rank
itself broke: such a rank exits with PEER_LOST (lazarus.core.exitcodes), or survives in place
(lazarus.trainer.inplace), and the daemon names the peer."""

from __future__ import annotations

from lazarus.core import exitcodes


def is_peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist  # here: the rank side imports torch only when it runs

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, (RuntimeError, ConnectionError)) and exitcodes.names_lost_peer(str(exc))
