"""The direct line: a call to a model replica without Serve's handle (``router.handle_transport:
direct``, the default, used for a model with one running replica: ``router/lines.py``;
docs/architecture.md, "The direct line").

The handle call costs a stream ~3 ms of TTFT on the 2-core host (Serve's request router, its
rejection protocol, gRPC, the replica's wrapper; docs/benchmarks.md, "The handle's transport").
On the direct line the router writes the call on a connection it keeps open to the replica's
byte listener, and reads the same items back (``messages.py``: the head, then the trailer or
answer); the stream's bytes still come on a byte socket of their own, with its ticket, exactly as
after a handle call.

Wire, on the replica's listener (TCP, or its Unix listener for a router on its node): the router
presents the replica's line key as a ticket (``<32 hex>\\n`` over TCP, mode ``S`` on the Unix
listener); the replica answers ``+`` (so that the first call's frame is never read along with the
line on the Unix socket, whose line is read by a plain ``recv``); then each call is one frame and
each item one frame back: a 4-byte big-endian length, then the pickled object. A call's last item
is its ``Answer`` or ``Trailer``; a ``Refused`` (full, stopping) is its only item. The connection
then takes the next call. The router closing it mid-call cancels the call (as Serve cancels a
handle call): the replica closes the generator, which aborts the engine request. Pickle is read
only after the key matched: whoever holds the key got it through the handle, inside Ray's trust
boundary (the same one Ray's own pickled tasks rely on), and the region's TLS option covers this
connection like the byte socket (docs/threat-model.md, "The stream listener").
"""

import asyncio
import pickle
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app.wire.messages import Answer, Call, Refused, Trailer

LENGTH = struct.Struct(">I")
READY = b"+"
MAX_FRAME_BYTES = 512 * 1024 * 1024  # a call's body (inline images included) or an answer's


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next object; ``asyncio.IncompleteReadError`` when the peer closed, ValueError for an
    oversized frame."""
    (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes on a direct line")
    return pickle.loads(await reader.readexactly(length))


def is_last(item: Any) -> bool:
    """A call's last item: nothing more comes for it on the line."""
    return isinstance(item, (Answer, Trailer, Refused))


# --- the replica's end --------------------------------------------------------------------------
# ``take(method, call)``: the call's items, or a ``Refused`` when the replica does not take it.
Taker = Callable[[str, Call], AsyncIterator | Refused]


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, take: Taker) -> None:
    """Serve one router's line: call after call, until it closes the connection."""
    try:
        writer.write(READY)
        while True:
            try:
                method, call = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the router closed its idle line
            items = take(method, call)
            if isinstance(items, Refused):
                writer.write(frame(items))
                continue
            if not await _answer(items, reader, writer):
                return
    finally:
        writer.close()


async def _answer(items: AsyncIterator, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Write the call's items; False if the router cancelled it (closed the line) first."""
    sending = asyncio.ensure_future(_send_all(items, writer))
    cancelled = asyncio.ensure_future(reader.read(1))  # the router writes nothing mid-call: EOF
    try:
        await asyncio.wait((sending, cancelled), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not sending.done():
            sending.cancel()
            await asyncio.wait([sending])
        if not cancelled.done():
            cancelled.cancel()
            await asyncio.wait([cancelled])
    if sending.cancelled() or sending.exception() is not None:
        return False
    return True


async def _send_all(items: AsyncIterator, writer: asyncio.StreamWriter) -> None:
    try:
        async for item in items:
            writer.write(frame(item))
            await writer.drain()
    finally:
        await items.aclose()  # cancelled between items: the generator's own cleanup still runs
