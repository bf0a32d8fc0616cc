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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from serve_app.wire.quiet import KEEPALIVE_FRAME, KEEPALIVE_S, Silent


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


@dataclass
class ClientLink:
    """What a stream's response and its body share: the client's connection, once the head is
    written to it and nothing else is pending (``socket``: a replica on this node may be handed
    it), and whether a replica writes to it now (``handed``: the router then writes nothing, not
    even a keep-alive comment, until the replica is done)."""

    socket: Any = None
    handed: bool = False
    pending: Any = None  # the bytes the router's transport still holds for the client (a callable)
    closing: Any = None  # whether the client's connection is closing or closed (a callable)

    def idle_socket(self) -> Any:
        """``socket`` if nothing the router wrote to the client still waits to go out, else None.
        A replica writing to the connection itself would overtake those bytes: a resumed stream's
        continuation, after keep-alive comments the router wrote to a slow client during the
        seam, is relayed instead of handed over."""
        if self.socket is None or (self.pending is not None and self.pending()):
            return None
        if self.closing is not None and self.closing():  # the client left: nothing to hand over
            return None
        return self.socket


class ClientStalled(Exception):
    """The client did not drain a write within the stall timeout."""


class RelayedStream(StreamingResponse):
    """A ``StreamingResponse`` whose body chunks skip the ASGI send chain when they can.

    ``on_end``: called once the response is over however it ended — also when the client left
    before the body's first chunk was asked for, when the body generator never started and so
    never ran its own ``finally`` (the relay's cleanup). ``stall_timeout_s``: how long one write
    may wait for a client that does not read before the stream ends (``DEFAULT_STALL_TIMEOUT_S``).
    ``keepalive_s``: how long an event stream may be silent before it sends a comment
    (``KEEPALIVE_S``; the first stream on an event loop sets the period for that loop's).
    """

    def __init__(self, *args, link: ClientLink | None = None, on_end: Callable[[], None] | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, keepalive_s: float = KEEPALIVE_S, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_end = on_end
        self.link = link or ClientLink()
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
            transport = cycle.transport
            # Handed over only as plain TCP (behind HAProxy), and once the head is in the kernel.
            if transport.get_extra_info("sslcontext") is None and not transport.get_write_buffer_size():
                self.link.socket = transport.get_extra_info("socket")
                self.link.pending, self.link.closing = transport.get_write_buffer_size, transport.is_closing
            self._cycle = cycle
            silent = Silent.of_this_loop(self.keepalive_s)
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
                silent.discard(self)
                self._cycle = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def keep_alive(self) -> None:
        """A comment to the client if nothing went to it since the last look, between two events
        (never inside one), and the connection takes writes (a slow reader is the stall bound's)."""
        cycle = self._cycle
        if self._wrote or not self._between_events or cycle is None or self.link.handed:
            self._wrote = False
            return
        if not cycle.disconnected and not cycle.flow.write_paused:
            cycle.transport.write(KEEPALIVE_FRAME)

    async def _unstalled(self, waiting) -> None:
        try:
            await asyncio.wait_for(waiting, self._stall_timeout_s)
        except asyncio.TimeoutError:
            raise ClientStalled from None
