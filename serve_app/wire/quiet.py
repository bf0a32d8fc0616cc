"""Keep-alive comments for event streams that have been silent a while, on either end of a stream.

A stream whose engine is silent (its request waits behind others in the engine, or prefills a
long prompt) sends its client an SSE comment about once a second. A proxy in front of the server
(HAProxy here, and cloud load balancers) passes on a client's departure only once a write to that
client fails: with nothing written, a client that left while its request waited held the
engine's slot until its first token (measured through HAProxy: 90 streams left at once took 8.5 s
to leave the engine, each queued one admitted, prefilled and aborted in turn; with the comments,
under a second: docs/reliability.md). Every SSE client skips comment lines (the official SDKs
do), and a comment also keeps an idle-timeout proxy from cutting a long prefill.

Whoever writes a stream's bytes sends its comments: the router for a stream it relays, the model
replica for one the router handed it (``wire/handoff.py``).
"""

import asyncio
import weakref
from typing import Protocol

KEEPALIVE_S = 1.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"
KEEPALIVE_FRAME = b"%x\r\n%b\r\n" % (len(KEEPALIVE_COMMENT), KEEPALIVE_COMMENT)  # HTTP/1.1 chunked


class Quiet(Protocol):
    def keep_alive(self) -> None:
        """Send a comment if nothing was written since the last call (and the stream may take one)."""


class Silent:
    """The event streams open on one event loop; every ``period_s`` each is asked to send a
    comment if it wrote nothing since the last look. One task for all of them, running only while
    there are any: no timer per stream or per chunk."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.streams: set[Quiet] = set()
        self._task: asyncio.Task | None = None

    @classmethod
    def of_this_loop(cls, period_s: float = KEEPALIVE_S) -> "Silent":
        loop = asyncio.get_running_loop()
        if loop not in _SILENT:
            _SILENT[loop] = cls(period_s)
        return _SILENT[loop]

    def add(self, stream: Quiet) -> None:
        self.streams.add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._look_every())

    def discard(self, stream: Quiet) -> None:
        self.streams.discard(stream)

    async def _look_every(self) -> None:
        while self.streams:
            await asyncio.sleep(self.period_s)
            for stream in list(self.streams):
                stream.keep_alive()


_SILENT: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Silent]" = weakref.WeakKeyDictionary()
