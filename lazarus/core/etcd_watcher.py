"""aetcd's watcher, told of the watches etcd cancels and of the token its stream carries.

aetcd multiplexes every watch of a client on one gRPC stream and misses two things that
etcd's authentication brings (docs/constraints.md, "Watches and etcd's tokens"):
- etcd checks a stream's token when a watch is created on it, and refuses a create it does
  not allow (a token it no longer knows, no right to the keys) with an answer that is both
  "created" and "canceled". aetcd takes that for a created watch, which then never delivers
  an event. Here a canceled answer ends the watch with `WatchCanceled`, whose `code` and
  `details` are those of the gRPC error etcd names in its reason.
- the token goes with the stream's opening request and cannot change afterwards; a new
  token is only used by a new stream. `renew` ends a stream that carries an old token, its
  watches with `StreamRenewed`, so that they are created again on a stream with the new one.
  Watches already created on a stream keep delivering when its token expires: etcd checks
  it at creation only.
"""

from __future__ import annotations

import re

import aetcd.exceptions as aexc
import aetcd.watcher
from aetcd import rpc

# etcd's cancel reason is a Go gRPC error as text: "rpc error: code = Unauthenticated desc =
# etcdserver: invalid auth token".
_REASON = re.compile(r"rpc error: code = (\w+) desc = (.*)", re.DOTALL)


class WatchCanceled(aexc.ClientError):
    """etcd canceled a watch, or refused to create it."""

    def __init__(self, reason: str):
        super().__init__(reason or "etcd canceled the watch")
        self.code, self.details = rpc.StatusCode.UNKNOWN, reason
        if match := _REASON.match(reason):
            name = re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).upper()  # PermissionDenied
            self.code = getattr(rpc.StatusCode, name, rpc.StatusCode.UNKNOWN)
            self.details = match.group(2)


class StreamRenewed(aexc.ClientError):
    """The watch stream was closed to open one with a new token: watch again at once."""


class Watcher(aetcd.watcher.Watcher):
    stream_metadata = None  # what the open stream was opened with

    async def setup(self) -> None:
        async with self._request_handler_lock:
            if self._request_handler is None:
                self.stream_metadata = self._metadata
        await super().setup()

    @property
    def stream_token(self) -> str | None:
        return dict(self.stream_metadata or ()).get("token")

    async def renew(self) -> None:
        """End the open stream when it carries other metadata (an old token) than new
        watches are to be created with."""
        if self._request_handler is not None and self.stream_metadata != self._metadata:
            await self._terminate_stream(StreamRenewed("the watch stream carried an old token"))

    async def _handle_response(self, response) -> None:
        if not response.canceled or response.compact_revision:
            # aetcd's own path: events, creations, and compacted revisions
            await super()._handle_response(response)
            return
        error = WatchCanceled(response.cancel_reason)
        async with self._lock:
            if response.created and self._new_callback is not None:
                self._new_callback.error = error  # refused at creation: add_callback raises it
                self._new_callback_ready.notify_all()
                return
            callback = self._callbacks.pop(response.watch_id, None)
        if callback is not None:
            await self._process_callback(callback, error)
