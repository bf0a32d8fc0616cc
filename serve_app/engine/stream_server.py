"""The replica's half of the byte path: a TCP listener that carries each stream's SSE bytes.

Tokens never cross a DeploymentHandle (docs/architecture.md, "The token path"). The router's
handle call carries control only: Serve routes it to a replica, counts it as an ongoing request
(admission, ``max_queued_requests``, autoscaling, graceful drain), and cancelling it aborts the
engine request. For a stream, the replica answers that call with a *head* naming this listener and
a one-time ticket; the router connects, sends the ticket, and from then on vLLM's SSE events are
written to that socket as bytes, as they are produced — one ``transport.write`` per event here,
one read per socket read on the router, so several tokens travel in one read whenever the router
is behind, and none waits for a timer. The handle call ends with the *trailer* (timing, usage).

Wire format, router → replica: ``<32 hex chars ticket>\\n``, then nothing: the router closing its
end is its hang-up (its client left), which stops the stream at once (``pump``). Replica → router:
the raw SSE bytes of the stream, then the replica closes the connection. Whether the stream ended
normally is said by the trailer, not by the socket.
"""

import asyncio
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

TICKET_BYTES = 16  # 32 hex characters on the wire
TICKET_LINE_LEN = 2 * TICKET_BYTES + 1
# How long the replica waits for the router to connect after sending the head. The router does so
# at once; this only bounds a router that died between the head and the connect.
CONNECT_TIMEOUT_S = 10.0
# Past this many bytes buffered for a router that reads slowly, the replica awaits the drain.
HIGH_WATER_BYTES = 256 * 1024


# A peer that vanished without a FIN or RST (its node crashed, the link was cut) is found by TCP
# keepalive: probed after this long idle, every interval, given up after count misses (~25 s),
# so neither end holds a stream (and the engine its KV cache) for the kernel's two hours.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Turn TCP keepalive on for the byte path's connection (either end)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


@dataclass(frozen=True)
class StreamConnection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def write(self, data: bytes) -> bool:
        """Queue ``data`` for the router; False when the router has gone (stop generating)."""
        if self.writer.is_closing():
            return False
        self.writer.write(data)
        return True

    def must_drain(self) -> bool:
        return self.writer.transport.get_write_buffer_size() > HIGH_WATER_BYTES

    async def drain(self) -> None:
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


async def pump(events: AsyncIterator, pass_on: Callable[[Any], str | None], connection: StreamConnection) -> bool:
    """Write each of ``events`` (as ``pass_on`` shapes it; None: drop it) to the router until the
    stream ends (True) or the router hangs up (False: its client left).

    The router sends nothing after its ticket, so end-of-file on the connection is its hang-up,
    noticed at once — also while the engine is still queueing or prefilling, when no write would
    fail yet. Writing stops then, the engine request is aborted (by the caller's ``aclose``), and
    the handle call still ends with its trailer: the tokens generated so far get billed.
    """
    writing = asyncio.ensure_future(_write_all(events, pass_on, connection))
    hang_up = asyncio.ensure_future(connection.reader.read(1))
    try:
        await asyncio.wait((writing, hang_up), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this call is cancelled: nothing may go on iterating ``events``
        hang_up.cancel()
        if not writing.done():
            writing.cancel()
            await _until_done(writing)
    if writing.cancelled():
        return False
    return writing.result()  # an engine failure raises here


async def _until_done(task: asyncio.Task) -> None:
    """Wait for a cancelled task to finish, however often this wait is cancelled meanwhile (the
    caller closes the generator the task iterates next, which must not be running then); a
    cancellation received here is raised once the task is done."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def _write_all(events: AsyncIterator, pass_on: Callable[[Any], str | None], connection: StreamConnection) -> bool:
    async for event in events:
        if (event := pass_on(event)) is None:
            continue
        if not connection.write(event.encode()):
            return False  # the router closed the socket: its client left
        if connection.must_drain():
            await connection.drain()
    return True


class Prefetched:
    """An async iterator whose first item is already being produced when it is made.

    vLLM's stream generator submits the request to the engine only when first iterated. Started
    before the head is yielded, the engine's queue and prefill overlap the head's trip to the
    router and the router's connect, instead of waiting for both.
    """

    def __init__(self, source):
        self._source = source
        self._first: asyncio.Future | None = asyncio.ensure_future(source.__anext__())

    def __aiter__(self) -> "Prefetched":
        return self

    async def __anext__(self):
        if self._first is not None:
            first, self._first = self._first, None
            return await first
        return await self._source.__anext__()

    async def aclose(self) -> None:
        """Stop the source (vLLM aborts the engine request), also while its first item is pending."""
        if self._first is not None:
            self._first.cancel()
            await _until_done(self._first)  # the source must not be running when it is closed
            self._first = None
        await self._source.aclose()


class StreamServer:
    """One listener per replica; matches each incoming connection to the stream that expects it."""

    def __init__(self, host: str):
        self.host = host
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._expected: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        """Listen on an ephemeral port; call in the event loop the streams are served on."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
            logger.info("stream listener on %s:%d", self.host, self.port)

    @property
    def address(self) -> list:
        return [self.host, self.port]

    def expect(self) -> tuple[str, asyncio.Future]:
        """A fresh ticket and the future its connection will resolve."""
        ticket = secrets.token_hex(TICKET_BYTES)
        future = asyncio.get_running_loop().create_future()
        self._expected[ticket] = future
        return ticket, future

    async def accept(self, ticket: str, future: asyncio.Future, timeout_s: float = CONNECT_TIMEOUT_S) -> StreamConnection:
        """The router's connection for ``ticket``; TimeoutError if it never comes."""
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._expected.pop(ticket, None)

    def forget(self, ticket: str) -> None:
        """Drop a ticket whose connection will never be accepted (the call ended first)."""
        self._expected.pop(ticket, None)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readexactly(TICKET_LINE_LEN), CONNECT_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            writer.close()
            return
        future = self._expected.get(line[:-1].decode("ascii", "replace"))
        if future is None or future.done():  # unknown, expired or reused ticket: not ours to serve
            writer.close()
            return
        keep_alive(writer)
        future.set_result(StreamConnection(reader, writer))

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
