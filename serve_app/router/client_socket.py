"""The last hop of the byte path: each relayed read written straight to the client's connection.

Behind direct ingress the router's ASGI ``send`` is a chain of wrappers — Starlette's error and
exception middleware, Serve's request-id middleware and its direct-ingress accounting — ending
in uvicorn's ``RequestResponseCycle.send``, which frames the bytes for chunked transfer and
writes them to the socket. For a stream that is several Python frames per relayed read (~25 % of
the router's CPU under load, docs/benchmarks.md). ``RelayedStream`` sends the response's start and
its end through that chain, as any response does, so every wrapper sees the status and the
completion; the body chunks in between go to the connection uvicorn holds, framed exactly as
uvicorn frames them. Ray's own byte relay takes the same shortcut.

Where the chain does not end in uvicorn (a test client, Serve's Python proxy when HAProxy is not
in front), it falls back to plain ASGI sends: same bytes, slower.
"""

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from fastapi.responses import StreamingResponse


def find_uvicorn_cycle(send: Callable) -> Any | None:
    """uvicorn's per-request cycle behind ``send``'s wrappers (followed through their closures)."""
    stack, seen = [send], set()
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        owner = getattr(fn, "__self__", None)
        if type(owner).__name__ == "RequestResponseCycle" and type(owner).__module__.startswith("uvicorn."):
            return owner
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(content):
                stack.append(content)
    return None


# A client that stops reading (a half-open connection: ``requests`` after its read timeout) but
# keeps its socket open fills the buffers back to the engine, which then holds its slot and KV
# cache without generating. Past this long with a write not drained, the stream ends as if the
# client had left: the replica stops the engine, the request is billed what it generated.
DEFAULT_STALL_TIMEOUT_S = 30.0


# A stream whose engine is silent (its request waits behind others in the engine, or prefills a
# long prompt) sends its client an SSE comment about this often. A proxy in front of the router
# (HAProxy here, and cloud load balancers) passes on a client's departure only once a write to
# that client fails: with nothing written, a client that left while its request waited held the
# engine's slot until its first token (measured through HAProxy: 90 streams left at once took
# 8.5 s to leave the engine, each queued one admitted, prefilled and aborted in turn; with the
# comments, under a second: docs/reliability.md). Every SSE client skips comment lines (the official SDKs do), and
# a comment also keeps an idle-timeout proxy from cutting a long prefill.
KEEPALIVE_S = 1.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"
_KEEPALIVE_FRAME = b"%x\r\n%b\r\n" % (len(KEEPALIVE_COMMENT), KEEPALIVE_COMMENT)


class ClientStalled(Exception):
    """The client did not drain a write within the stall timeout."""


class _Silent:
    """The event streams open on one event loop; every ``period_s`` each that wrote nothing since
    the last look, and whose bytes so far end with a whole event, gets a keep-alive comment. One
    task for all of them, running only while there are any: no timer per stream or per chunk."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.streams: set["RelayedStream"] = set()
        self._task: asyncio.Task | None = None

    @classmethod
    def of_this_loop(cls, period_s: float) -> "_Silent":
        loop = asyncio.get_running_loop()
        if loop not in _SILENT:
            _SILENT[loop] = cls(period_s)
        return _SILENT[loop]

    def add(self, stream: "RelayedStream") -> None:
        self.streams.add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._look_every())

    async def _look_every(self) -> None:
        while self.streams:
            await asyncio.sleep(self.period_s)
            for stream in list(self.streams):
                stream.keep_alive()


_SILENT: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Silent]" = weakref.WeakKeyDictionary()


class RelayedStream(StreamingResponse):
    """A ``StreamingResponse`` whose body chunks skip the ASGI send chain when they can.

    ``on_end``: called once the response is over however it ended — also when the client left
    before the body's first chunk was asked for, when the body generator never started and so
    never ran its own ``finally`` (the relay's cleanup). ``stall_timeout_s``: how long one write
    may wait for a client that does not read before the stream ends (``DEFAULT_STALL_TIMEOUT_S``).
    ``keepalive_s``: how long an event stream may be silent before it sends a comment
    (``KEEPALIVE_S``; the first stream on an event loop sets the period for that loop's).
    """

    def __init__(self, *args, on_end: Callable[[], None] | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, keepalive_s: float = KEEPALIVE_S, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_end = on_end
        self._stall_timeout_s = stall_timeout_s
        self.keepalive_s = keepalive_s
        self._cycle: Any = None  # uvicorn's, while body chunks go straight to its connection
        self._wrote = False  # a chunk went out since the keep-alive task last looked
        self._between_events = True  # what went out so far ends with a whole SSE event

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_end is not None:
                self._on_end()

    async def stream_response(self, send: Callable) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        cycle = find_uvicorn_cycle(send)
        direct = cycle is not None and getattr(cycle, "chunked_encoding", False) and hasattr(cycle, "flow")
        if direct and self.media_type == "text/event-stream":
            self._cycle = cycle
            silent = _Silent.of_this_loop(self.keepalive_s)
            silent.add(self)
        try:
            async for chunk in self.body_iterator:
                if not chunk:
                    continue  # an empty chunk would read as the end of the body
                if not direct:
                    await self._unstalled(send({"type": "http.response.body", "body": chunk, "more_body": True}))
                elif cycle.disconnected:
                    await self.body_iterator.aclose()  # the client left: its finally aborts the request
                    break
                else:
                    if cycle.flow.write_paused:  # uvicorn's own back-pressure: the client is slow
                        await self._unstalled(cycle.flow.drain())
                    cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    self._wrote, self._between_events = True, chunk.endswith(b"\n\n")
        except ClientStalled:
            await self.body_iterator.aclose()  # its finally ends the request as abandoned
            if not direct:
                return  # the server's send itself is stuck: it ends the connection
            cycle.transport.close()  # cut: the client will not read an end of the body anyway
        finally:
            if self._cycle is not None:
                silent.streams.discard(self)
                self._cycle = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def keep_alive(self) -> None:
        """A comment to the client if nothing went to it since the last look, between two events
        (never inside one), and the connection takes writes (a slow reader is the stall bound's)."""
        cycle = self._cycle
        if self._wrote or not self._between_events or cycle is None:
            self._wrote = False
            return
        if not cycle.disconnected and not cycle.flow.write_paused:
            cycle.transport.write(_KEEPALIVE_FRAME)

    async def _unstalled(self, waiting) -> None:
        try:
            await asyncio.wait_for(waiting, self._stall_timeout_s)
        except asyncio.TimeoutError:
            raise ClientStalled from None
