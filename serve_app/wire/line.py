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

from serve_app.telemetry.logs import module_logger
from serve_app.wire.messages import Answer, Call, Refused, Trailer

logger = module_logger(__name__)

LENGTH = struct.Struct(">I")
READY = b"+"
MAX_FRAME_BYTES = 512 * 1024 * 1024  # a call's body (inline images included) or an answer's


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, early: bytes = b"") -> Any:
    """The next object (``early``: its first bytes, read already); ``asyncio.IncompleteReadError``
    when the peer closed, ValueError for an oversized frame."""
    (length,) = LENGTH.unpack(early + await reader.readexactly(LENGTH.size - len(early)))
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
    early = b""  # the next call's first byte, when the watch for a hang-up read it
    try:
        writer.write(READY)
        while True:
            try:
                method, call = await read_frame(reader, early)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the router closed its idle line
            except Exception:  # not a frame of ours (oversized, or a pickle this code cannot read)
                logger.exception("a direct line sent what is not a call; closing it")
                return
            items = take(method, call)
            if isinstance(items, Refused):
                writer.write(frame(items))
                early = b""
                continue
            early = await _answer(items, reader, writer)
            if early is None:
                return
    finally:
        writer.close()


async def _answer(items: AsyncIterator, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
    """Write the call's items, watching the line meanwhile: the router writes nothing mid-call,
    so end-of-file there is its cancel (the generator is closed, which aborts the engine
    request), and None is returned, as when the line fails. Once the last item is written the
    router may send its next call while that item still drains: the watch's byte is that call's
    first, and is returned to be read with it (else b"")."""
    wrote_last = [False]
    sending = asyncio.ensure_future(_send_all(items, writer, wrote_last))
    watching = asyncio.ensure_future(reader.read(1))
    try:
        await asyncio.wait((sending, watching), return_when=asyncio.FIRST_COMPLETED)
        if watching.done() and not sending.done() and _read(watching) and wrote_last[0]:
            await asyncio.wait([sending])  # the next call came while the last item drained
    finally:
        for task in (sending, watching):
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
    if sending.cancelled() or sending.exception() is not None:
        return None
    if not watching.done() or watching.cancelled():
        return b""
    return _read(watching) or None  # end-of-file right after the last item: the router closed


def _read(watching: asyncio.Future) -> bytes:
    """What the watch read; b"" for end-of-file or a failed line."""
    if watching.cancelled() or watching.exception() is not None:
        return b""
    return watching.result()


async def _send_all(items: AsyncIterator, writer: asyncio.StreamWriter, wrote_last: list[bool]) -> None:
    try:
        async for item in items:
            writer.write(frame(item))
            wrote_last[0] = is_last(item)
            await writer.drain()
    finally:
        await items.aclose()  # cancelled between items: the generator's own cleanup still runs
