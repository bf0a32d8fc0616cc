"""The hand-off: a router on the replica's node gives the replica its client's connection, and the
replica writes the stream's bytes to the client itself. No Python process of the router touches
a token (issue #24, docs/architecture.md "The hand-off"). A region's option
(``router.hand_off_streams``): on in the local CPU region, where the router's relay queues for the
one CPU the engine's worker leaves (16 streams' TTFT −1 % against bare vLLM with it, +23 %
without); off by default, so a GPU region keeps the per-token socket cost off vLLM's front end
(docs/benchmarks.md).

The byte socket (``socket.py``) makes the router relay every read: one receive and one write per
read. A router and a replica on one node share a kernel, so the router can pass the
client's connection itself (``SCM_RIGHTS`` over a Unix socket) and step aside until the engine is
done. What the router keeps is everything it decides: the request is admitted, priced, routed,
started and answered with its status line and headers by the router, which still writes the
stream's closing (the timing chunk and ``[DONE]``, or the terminal event), bills the trailer's
usage and resumes a stream whose engine failed.

Wire, router → replica, on the replica's Unix listener (an abstract socket: nothing on disk),
after connecting: ``<32 hex ticket><mode><stall ms>\\n``, in one message, the client's
connection attached when ``mode`` hands it over:

- ``S``: the stream comes on this connection, as on the TCP byte socket (no hand-off: a test
  client, or a router without uvicorn's connection);
- ``H``: write the stream to the attached connection, HTTP/1.1 chunk-framed (the router wrote the
  status line and headers, ``Transfer-Encoding: chunked``, and writes the rest after); ``K``: the
  same, and keep what was written, for a stream the router may resume (``Trailer.written``).

In both hand-off modes the replica also writes the stream's first write to the Unix connection
(the router marks the first byte and names its closing after the first event), sends keep-alive
comments while the engine is silent (``quiet.py``), cuts a client that reads nothing for the stall
time, and closes the Unix connection once every byte is in the kernel: only then does the router
write again, so the two never interleave. The router closing the Unix connection is still its
hang-up (its client left).
"""

import asyncio
import functools
import os
import secrets
import socket

from serve_app.wire.quiet import KEEPALIVE_FRAME, Silent

LINE_MAX = 64  # ticket, mode, stall ms and newline
MODES = {"S": "stream here", "H": "hand over", "K": "hand over, keep what is written"}


def local_address() -> str:
    """A fresh abstract Unix socket name for one replica's listener (Linux: no file to clean up)."""
    return f"\0serve_app-stream-{os.getpid()}-{secrets.token_hex(8)}"


@functools.cache
def this_node() -> str | None:
    """The Ray node this process runs on; None outside Ray (then nothing is handed over)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_node_id()
    except Exception:  # not a Ray worker
        return None


def line(ticket: str, mode: str, stall_s: float) -> bytes:
    return f"{ticket}{mode}{int(stall_s * 1000)}\n".encode("ascii")


def parse_line(data: bytes) -> tuple[str, str, float] | None:
    """(ticket, mode, stall seconds) of a well-formed line, else None."""
    text = data.decode("ascii", "replace").rstrip("\n")
    ticket, mode, stall = text[:32], text[32:33], text[33:]
    if len(ticket) != 32 or mode not in MODES or not stall.isdigit():
        return None
    return ticket, mode, int(stall) / 1000


# --- the router's end ---------------------------------------------------------------------------
async def connect(address: str) -> socket.socket:
    """A connection to a replica's Unix listener; OSError when it is not there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


async def open_streams(sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over a connected Unix socket (either end), whose descriptor is then the transport's
    alone: ``sock`` is not to be used or closed after this.

    uvloop's transport (the loop of every Ray actor here) does its I/O on the descriptor and keeps
    ``sock`` only to detach it when it closes. A transport left open and collected in a reference
    cycle together with ``sock`` would have the socket's finalizer close the descriptor, and libuv
    close the same number again a loop turn later, when by then it may be another connection's
    (the router's next client: uvicorn failed in ``connection_made`` with EBADF). Detached here,
    only libuv ever closes it. asyncio's own transports do their I/O through ``sock``: theirs."""
    try:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    except (KeyboardInterrupt, SystemExit):
        raise  # uvloop leaves its transport open then: closing ``sock`` too would close it twice
    except BaseException:
        sock.close()  # uvloop has detached it already: then a no-op
        raise
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        sock.detach()
    return reader, writer


def present(fd: int, ticket: str, mode: str, stall_s: float, client: socket.socket | None) -> None:
    """Send the line on the Unix connection ``fd``, with ``client``'s connection attached for a
    hand-over (``H``, ``K``). The message is tens of bytes into an empty Unix socket: it does not
    block. OSError when the replica is gone (or the connection closed)."""
    if fd < 0:
        raise ConnectionError("the connection to the replica is closed")
    data = line(ticket, mode, stall_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd)  # borrowed: the transport owns ``fd``
    try:
        if client is None:
            sock.send(data)
        else:
            socket.send_fds(sock, [data], [client.fileno()])
    finally:
        sock.detach()


# --- the replica's end --------------------------------------------------------------------------
async def receive_line(sock: socket.socket, timeout_s: float) -> tuple[bytes, list[int]]:
    """The router's line and the connection it attached (if any), read with the ancillary data a
    plain read would drop. Raises TimeoutError, or ConnectionError when the router closed first."""
    loop = asyncio.get_running_loop()
    data, fds = b"", []

    async def read() -> None:
        nonlocal data
        while not data.endswith(b"\n"):
            readable = loop.create_future()
            loop.add_reader(sock.fileno(), lambda: readable.done() or readable.set_result(None))
            try:
                await readable
            finally:
                loop.remove_reader(sock.fileno())
            try:
                chunk, got, _flags, _addr = socket.recv_fds(sock, LINE_MAX - len(data), 1)
            except BlockingIOError:
                continue
            fds.extend(got)
            if not chunk or len(data) + len(chunk) > LINE_MAX:
                raise ConnectionError("the router closed before its line, or sent too much")
            data += chunk

    try:
        await asyncio.wait_for(read(), timeout_s)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return data, fds


class ClientWriter:
    """The replica's end of a handed-over client connection: each write one chunk-framed
    ``send`` (the kernel's buffer is the only buffer), the rest of a partial one sent before the
    next, a client that drains nothing for ``stall_s`` cut. Never shut down: the router's copy of
    the connection goes on after this one is closed."""

    def __init__(self, fd: int, *, keep: bool, stall_s: float, first_to: asyncio.StreamWriter):
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.stall_s = stall_s
        self.written = bytearray() if keep else None  # what the client has, for a resume
        self.pending = b""  # the unsent rest of a frame the kernel took part of
        self.gone = False  # the client's connection failed, or it stalled
        self.stalled = False
        self._first_to: asyncio.StreamWriter | None = first_to
        self._wrote = False
        # A frame's rest is on its way (``drain``): nothing else may reach the socket before it
        # ends, or it lands inside that frame (a keep-alive in the middle of a chunk).
        self._draining = False
        self._silent = Silent.of_this_loop()
        self._silent.add(self)

    def write(self, data: bytes) -> bool:
        """Queue ``data`` for the client; False once its connection has failed."""
        if self.gone:
            return False
        if self._first_to is not None:  # the router's copy of the opening
            self._first_to.write(data)
            self._first_to = None
        if self.written is not None:
            self.written += data
        self._wrote = True
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        if self.pending or self._draining:
            self.pending += frame
            return True
        return self._send(frame)

    def must_drain(self) -> bool:
        return bool(self.pending)

    async def drain(self) -> None:
        """Send what the kernel did not take; a client that takes none of it for the stall time
        is gone (ConnectionError: the caller stops)."""
        self._draining = True
        try:
            while self.pending and not self.gone:
                rest, self.pending = self.pending, b""
                try:
                    await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(self.sock, rest), self.stall_s)
                except asyncio.TimeoutError:
                    self.gone = self.stalled = True
                    raise ConnectionError("the client read nothing for the stall time") from None
                except OSError:
                    self.gone = True
        finally:
            self._draining = False

    def keep_alive(self) -> None:
        if self._wrote or self.pending or self._draining or self.gone:
            self._wrote = False
            return
        self._send(KEEPALIVE_FRAME)

    def close(self) -> None:
        self._silent.discard(self)
        self.sock.close()  # this process's descriptor only: the connection stays the router's

    def _send(self, frame: bytes) -> bool:
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError:  # the client (or the proxy before it) closed the connection
            self.gone = True
            return False
        if sent < len(frame):
            self.pending = frame[sent:]
        return True
