"""The byte socket between a router and a model replica: one TCP connection per request (or,
for a router on the replica's node, one on the replica's Unix listener, whose line and hand-off
``handoff.py`` describes).

Tokens never cross a DeploymentHandle (docs/architecture.md, "The token path"). The handle call
carries control; when the replica has bytes for the router (a stream) or must learn that the
router gave up (a non-stream request under way), it names its listener and a one-time ticket in
its first item (``messages.StreamOpen`` / ``messages.Accepted``) and the router connects.

Wire format, router → replica: ``<32 hex chars ticket>\\n``, then nothing: the router closing its
end is its hang-up (its client left), which the replica notices at once (``pump``, ``hung_up``),
also while the engine is still queueing or prefilling. Replica → router: the raw SSE bytes of the
stream (nothing for a non-stream request), then the replica closes the connection. How the
request ended is said by the handle's last item (the trailer), never by the socket.

An unknown, expired or reused ticket gets the connection closed without a byte. Both ends use TCP
keepalive, so a peer that vanished without a FIN or RST (its node lost) is found in ~25 s. A region
may put TLS 1.3 on the connection (``tls.py``); the head says whether it does.
"""

import asyncio
import hmac
import os
import secrets
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from serve_app.wire import handoff
from serve_app.wire import tls as tls_options
from serve_app.wire.listen_port import stream_listen_socket
from serve_app.wire.messages import Address

TICKET_BYTES = 16  # 32 hex characters on the wire
TICKET_LINE_LEN = 2 * TICKET_BYTES + 1
# How long the replica waits for the router to connect after naming the socket. The router does
# so at once; this only bounds a router that died in between. Also the router's connect timeout.
CONNECT_TIMEOUT_S = 10.0
# Past this many bytes buffered for a router that reads slowly, the replica awaits the drain.
HIGH_WATER_BYTES = 256 * 1024
# A peer that vanished without a FIN or RST: probed after this long idle, every interval, given
# up after count misses (~25 s), so neither end holds a request (and the engine its KV cache) for
# the kernel's two hours.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
# One read on the router: whatever the replica has written, up to this much.
READ_BYTES = 64 * 1024


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Turn TCP keepalive on for the byte socket (either end)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


# --- the router's end ---------------------------------------------------------------------------
async def connect(address: Address, ticket: str, *, tls: bool = False) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a replica's listener (over TLS when ``tls``, verified as ``wire/tls.py`` says)
    and present ``ticket``. Raises ``OSError`` (``ssl.SSLError`` included) or ``TimeoutError``
    when the listener cannot be reached or proves no identity."""
    host, port = address
    context, name = tls_options.client_context() if tls else (None, None)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=context, server_hostname=name), CONNECT_TIMEOUT_S
    )
    keep_alive(writer)
    writer.write(ticket.encode("ascii") + b"\n")
    return reader, writer


# --- the replica's end --------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamConnection:
    """The router's connection for one request; ``client``: the client's own connection, when
    the router handed it over (``handoff.py``): the stream's bytes go there."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    client: handoff.ClientWriter | None = None

    def write(self, data: bytes) -> bool:
        """Queue ``data`` for the router (or the client); False when it has gone (stop generating)."""
        if self.client is not None:
            return self.client.write(data)
        if self.writer.is_closing():
            return False
        self.writer.write(data)
        return True

    def must_drain(self) -> bool:
        if self.client is not None:
            return self.client.must_drain()
        return self.writer.transport.get_write_buffer_size() > HIGH_WATER_BYTES

    async def drain(self) -> None:
        if self.client is not None:
            await self.client.drain()
        else:
            await self.writer.drain()

    async def flush(self) -> None:
        """Every byte of a handed-over stream in the kernel before the router writes again (a
        relayed stream's bytes are ordered by the connection itself)."""
        if self.client is not None:
            await self.client.drain()

    @property
    def client_gone(self) -> bool:
        """The handed-over client's connection failed, or the client read nothing for too long."""
        return self.client is not None and self.client.gone

    async def hung_up(self) -> None:
        """Returns when the router closes its end (it sends nothing after its ticket)."""
        await self.reader.read(1)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.writer.close()


async def pump(events: AsyncIterator, pass_on: Callable[[Any], str | None], connection: StreamConnection) -> bool:
    """Write each of ``events`` (as ``pass_on`` shapes it; None: drop it) to the router until the
    stream ends (True) or the router hangs up (False: its client left).

    End-of-file on the connection is the router's hang-up, noticed at once — also while the engine
    is still queueing or prefilling, when no write would fail yet. Writing stops then, the engine
    request is aborted (by the caller's ``aclose`` of ``events``), and the handle call still ends
    with its trailer: the tokens generated so far get billed.
    """
    writing = asyncio.ensure_future(_write_all(events, pass_on, connection))
    if await first_of(writing, connection):
        return writing.result()  # an engine failure raises here
    return False


async def first_of(work: asyncio.Future, connection: StreamConnection) -> bool:
    """Wait for ``work`` or the router's hang-up, whichever comes first: True if ``work`` finished.
    On a hang-up (or when this wait is cancelled) ``work`` is cancelled and waited for, so that
    nothing goes on running what the caller is about to close."""
    hang_up = asyncio.ensure_future(connection.hung_up())
    try:
        await asyncio.wait((work, hang_up), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hang_up.cancel()
        if not work.done():
            work.cancel()
            await until_done(work)
    return not work.cancelled()


class KeptRead:
    """The next item of ``read``, read by one task that a cancelled wait does not stop.

    A client that leaves cancels the router's wait for a call's next item; the read itself must go
    on — a frame half read would have its rest taken for a length, a handle call's item is used up
    once its read began — and the next wait (the one for the call's last item, whose usage is the
    bill) takes what it brings, also when it came in the very turn the client left.

    ``read(*args)`` is given with each wait, and used only when no read is under way: a call keeps no
    closure over itself, so its objects form no reference cycle and are freed as soon as dropped."""

    __slots__ = ("_task",)

    def __init__(self):
        self._task: asyncio.Future | None = None

    async def next(self, read: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        if self._task is None:
            self._task = asyncio.ensure_future(read(*args))
        try:
            item = await asyncio.shield(self._task)
        except asyncio.CancelledError:
            raise  # the read goes on, or has its item: the next wait takes it
        except BaseException:
            self._task = None
            raise
        self._task = None
        return item

    def cancel(self) -> None:
        """Give up on a read under way (its end, an error or cancelled, is not logged as lost)."""
        if (task := self._task) is not None:
            self._task = None
            task.cancel()
            task.add_done_callback(_read_out)


def _close_all(fds: list[int]) -> None:
    """Close the descriptors a router attached, each once: taken out of ``fds`` as it is closed."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _read_out(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def until_done(task: asyncio.Future) -> None:
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
            return False  # the router closed the socket (its client left), or the client's failed
        if connection.must_drain():
            await connection.drain()
    await connection.flush()
    return not connection.client_gone


class Listener:
    """One per replica; matches each incoming connection to the request that expects it.
    ``ssl_context``: serve TLS only (``tls.server_context``); None, plaintext. ``on_line``: serves
    a connection that presents ``line_key`` (a router's direct line, ``line.py``)."""

    def __init__(self, host: str, ssl_context: ssl.SSLContext | None = None,
                 on_line: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any] | None = None):
        self.host = host
        self.ssl_context = ssl_context
        self._on_line = on_line
        self.line_key = secrets.token_hex(TICKET_BYTES) if on_line is not None else None
        self._lines: set[asyncio.Task] = set()
        self.port: int | None = None
        self.local: str | None = None  # the Unix listener for routers on this node (``handoff.py``)
        self._server: asyncio.Server | None = None
        self._local: socket.socket | None = None
        self._local_tasks: set[asyncio.Task] = set()
        self._expected: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        """Listen, on the first free port of ``SERVE_APP_STREAM_PORTS`` (the range a region's
        NetworkPolicy opens to its Ray pods only, ``listen_port.py``) or else any port; call in the
        event loop the requests are served on. OSError when no port of the range is free."""
        if self._server is None:
            self._server = await asyncio.start_server(
                self._accept, sock=stream_listen_socket(self.host), ssl=self.ssl_context,
                ssl_handshake_timeout=CONNECT_TIMEOUT_S if self.ssl_context else None,
            )
            self.port = self._server.sockets[0].getsockname()[1]
        if self._local is None and sys.platform == "linux":  # abstract Unix sockets are Linux's
            self._local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._local.setblocking(False)
            self._local.bind(address := handoff.local_address())
            self._local.listen(256)
            self.local = address
            self._local_tasks.add(asyncio.get_running_loop().create_task(self._serve_local()))

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    @property
    def tls(self) -> bool:
        """What each head says, so that the router connects alike."""
        return self.ssl_context is not None

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
        """Drop a ticket whose connection will never be accepted (the call ended first). A router
        connecting for it meanwhile finds its future cancelled, and its connection closed."""
        future = self._expected.pop(ticket, None)
        if future is not None:
            future.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readexactly(TICKET_LINE_LEN), CONNECT_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            writer.close()
            return
        ticket = line[:-1].decode("ascii", "replace")
        if self._is_line_key(ticket):
            keep_alive(writer)
            self._serve_line(reader, writer)
            return
        future = self._expected.get(ticket)
        if future is None or future.done():  # unknown, expired or reused ticket: not ours to serve
            writer.close()
            return
        keep_alive(writer)
        future.set_result(StreamConnection(reader, writer))

    async def _serve_local(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._local)
            connection.setblocking(False)
            task = loop.create_task(self._accept_local(connection))
            self._local_tasks.add(task)
            task.add_done_callback(self._local_tasks.discard)

    async def _accept_local(self, connection: socket.socket) -> None:
        """A router on this node: its line says whether it handed its client's connection over."""
        try:
            data, fds = await handoff.receive_line(connection, CONNECT_TIMEOUT_S)
        except BaseException as err:  # timed out, closed (ConnectionError), or this listener closing
            connection.close()
            if not isinstance(err, (asyncio.TimeoutError, OSError)):
                raise
            return
        try:
            await self._start_local(connection, data, fds)
        except BaseException:  # this listener closing while it opened the streams: nothing is served
            _close_all(fds)  # what no ClientWriter took
            connection.close()  # detached once the transport took it: then a no-op
            raise

    async def _start_local(self, connection: socket.socket, data: bytes, fds: list[int]) -> None:
        parsed = handoff.parse_line(data)
        if parsed is not None and self._is_line_key(parsed[0]) and parsed[1] == "S" and not fds:
            self._serve_line(*await handoff.open_streams(connection))
            return
        future = self._expected.get(parsed[0]) if parsed else None
        handed = parsed is not None and parsed[1] != "S"
        if future is None or future.done() or handed != (len(fds) == 1):  # not ours, or malformed
            _close_all(fds)
            connection.close()
            return
        _, mode, stall_s = parsed
        reader, writer = await handoff.open_streams(connection)
        # Taken out of ``fds`` as the ClientWriter takes it: its to close, never closed here again.
        client = handoff.ClientWriter(fds.pop(), keep=mode == "K", stall_s=stall_s, first_to=writer) if handed else None
        if future.done():  # the wait for it ended meanwhile
            StreamConnection(reader, writer, client).close()
            return
        future.set_result(StreamConnection(reader, writer, client))

    def _is_line_key(self, ticket: str) -> bool:
        # Bytes: a line of non-ASCII garbage decodes to a str compare_digest refuses.
        return self.line_key is not None and hmac.compare_digest(ticket.encode(), self.line_key.encode())

    def _serve_line(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._on_line(reader, writer))
        self._lines.add(task)
        task.add_done_callback(self._lines.discard)

    def close(self) -> None:
        for task in self._lines:  # the routers' direct lines: they find the connection closed
            task.cancel()
        if self._server is not None:
            self._server.close()
        if self._local is not None:
            for task in self._local_tasks:
                task.cancel()
            self._local.close()
