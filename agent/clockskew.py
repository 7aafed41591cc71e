"""This host's wall clock against the etcd leader's.

etcd's gRPC API carries no time (a response header has revisions and ids, a lease only a
countdown), but every member serves HTTP on its client port, and Go's HTTP server stamps each
answer with a `Date` header: the member's wall clock, to the second. One answer bounds the
offset within a second; the moment the stamp turns to the next second pins it down (what
htpdate does). `measure` asks the leader's `/version` every POLL_S until the second turns --
at most about 1 s and 1 / POLL_S requests -- and brackets the turn between the last request
that saw the old second and the first that saw the new one:

    the leader's clock read D + 1 at some instant of the first new answer's round trip
    [send, recv], and still read D at some instant of the old one's, so
    offset = leader - local  lies in  [D + 1 - recv_new, D + 1 - send_old]

The width of that interval is POLL_S plus both round trips; the midpoint is the estimate.
"""

from __future__ import annotations

import email.utils
import ssl
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

# Between two requests: the resolution of the measurement, and 1 / POLL_S requests at most.
POLL_S = 0.02
# A turn of the second is awaited this long at most (one second and some slack).
WINDOW_S = 1.3


@dataclass(frozen=True, slots=True)
class Skew:
    offset_s: float        # the leader's clock minus ours (positive: ours is behind)
    uncertainty_s: float   # the offset lies within offset_s +- this
    requests: int


def stamp(url: str, context: ssl.SSLContext | None, timeout_s: float) -> int:
    """The Date header of one answer, as whole seconds since the epoch."""
    with urllib.request.urlopen(url, timeout=timeout_s, context=context) as reply:
        reply.read()
        date = reply.headers.get("Date")
    if not date:
        raise ValueError(f"{url} answered without a Date header")
    return int(email.utils.parsedate_to_datetime(date).timestamp())


def measure(url: str, *, context: ssl.SSLContext | None = None,
            clock: Callable[[], float] = time.time, timeout_s: float = 2.0,
            poll_s: float = POLL_S) -> Skew:
    """The offset of the clock behind `url` (an etcd member's /version) from `clock`. Raises
    OSError when the member does not answer, ValueError when it answers without a date."""
    requests = 0
    old: tuple[float, int] | None = None        # (send time, stamp) of the last old-second answer
    deadline = time.monotonic() + WINDOW_S
    while True:
        send = clock()
        second = stamp(url, context, timeout_s)
        recv = clock()
        requests += 1
        if old is not None and second > old[1]:
            # The turn to `second` came after old's send and before this answer came.
            low, high = second - recv, second - old[0]
            return Skew(offset_s=(low + high) / 2, uncertainty_s=(high - low) / 2,
                        requests=requests)
        old = (send, second)
        if time.monotonic() > deadline:
            raise ValueError(f"{url}: its Date header did not move in {WINDOW_S} s")
        time.sleep(poll_s)


def judge(skew: Skew, limit_s: float) -> tuple[bool, str]:
    """(ok, reason): a clock is off when even the most favourable reading of the interval
    is beyond the limit, so a slow network alone never fails a node."""
    nearest = max(0.0, abs(skew.offset_s) - skew.uncertainty_s)
    way = "behind" if skew.offset_s > 0 else "ahead of"
    text = (f"clock {abs(skew.offset_s):.3f} s {way} the etcd leader's "
            f"(+- {skew.uncertainty_s:.3f} s)")
    if nearest > limit_s:
        return False, f"{text}, limit {limit_s:g} s"
    return True, text
