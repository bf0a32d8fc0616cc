"""The relay: the replica's bytes to the client, and the surface's closing after them.

A stream's SSE bytes come on the byte socket (``wire/socket.py``) and go to the client as each
read returns them — several tokens in one write when the client or the router is behind, never
held for a timer. When the replica closes the socket the engine is done, and the handle's last
item, the trailer, says how it ended; the router then sends the surface's closing
(``surfaces/dialects.py``: chat and completions' timing chunk and ``[DONE]``, or the terminal
event the replica held back, with the timing inside) or, when the stream broke, an error event in
the surface's dialect. A JSON answer is one body with ``pg_metadata`` added and its timing in
``Server-Timing``.

The relay reads nothing of what it relays but the first event (its id names the timing chunk) and,
for Responses, the last ``sequence_number`` (an error event continues the numbering) and, until it
passes, where the first output begins (``FirstOutput``: the stream's TTFT).
"""

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from serve_app.errors import engine_failed_mid_stream, error_body
from serve_app.router.client_socket import ClientLink, ClientStalled, RelayedStream
from serve_app.router.context import STORE_WAIT_S, Context, abandoned, even_if_left, failed, served
from serve_app.surfaces import seam
from serve_app.telemetry.logs import module_logger
from serve_app.wire.messages import ENGINE_UNAVAILABLE, Answer
from serve_app.wire.socket import READ_BYTES
from serve_app.wire.sse import first_event

logger = module_logger(__name__)


# Responses: vLLM yields these before the engine has made a token (the replica even sends them
# ahead of its head, engine/prefetch.py); a stream's first output is the first other event.
_OPENING_EVENTS = (b"event: response.created", b"event: response.in_progress")


class FirstOutput:
    """Whether a stream's first output has passed, read off its bytes (the first few reads only):
    the moment its TTFT is measured to. Chat, completions and Messages: their first bytes, as
    vLLM writes nothing before the engine's first output. Responses: the first event that is not
    one of ``_OPENING_EVENTS`` (nor an SSE comment). A handed-over stream (``wire/handoff.py``)
    shows the router its first write only: if that holds just the opening events, none passes
    here, and the TTFT falls back to the server time less the engine's decode (``compute_split``)."""

    def __init__(self, surface: str):
        self.passed = False
        self._any = surface != "responses"  # any first bytes are output
        self._rest = b""  # the start of a frame whose first line has not all come yet
        self._skipping = False  # inside an opening event or a comment: looking for its end

    def saw(self, data: bytes) -> bool:
        """True once the stream's bytes so far, ``data`` the latest, hold its first output."""
        if self.passed or self._any:
            self.passed = True
            return True
        text, at = self._rest + data, 0
        self._rest = b""
        while True:
            if self._skipping:
                end = text.find(b"\n\n", at)
                if end < 0:
                    self._rest = text[-1:]  # the end's first newline may be this read's last byte
                    return False
                at, self._skipping = end + 2, False
            line_end = text.find(b"\n", at)
            if line_end < 0:
                self._rest = text[at:]
                return False
            line = text[at:line_end]
            if not line:
                at = line_end + 1
            elif line.startswith(b":") or line in _OPENING_EVENTS:
                at, self._skipping = line_end, True
            else:
                self.passed = True
                return True


class StreamBrokeOff(Exception):
    """The replica's trailer says its stream ended before the engine finished (``code``: why)."""

    def __init__(self, code: str | None):
        super().__init__(f"the replica's stream ended before the engine finished ({code or 'connection lost'})")
        self.code = code


async def answer(ctx: Context, reply: Answer) -> Response:
    """A whole answer: timing in ``Server-Timing`` and, on success, ``pg_metadata``."""
    ctx.note_trailer(reply.trailer)
    if reply.trailer is None and reply.status < 500:  # a refusal, no token handled (``note_engine_untouched``);
        ctx.telemetry.note_engine_untouched()  # a 5xx has no trailer either, its engine may have run
    status, body = reply.status, reply.body
    error = body.get("error") if status >= 400 else None
    code = (error or {}).get("code") or (error or {}).get("type")
    if ctx.keep is not None and status == 200:
        await kept(ctx, body)
    ctx.note_counted(reply)
    ctx.telemetry.finish(status, code)
    headers = {**ctx.headers, **ctx.telemetry.headers()}
    if reply.encoded is not None:  # JSON already (embeddings' vectors): pg_metadata goes in as text
        content = with_member(reply.encoded, "pg_metadata", ctx.telemetry.metadata())
        ctx.settle(served(status, code))
        return Response(content, status_code=status, headers=headers, media_type="application/json")
    if status < 400:
        body["pg_metadata"] = ctx.telemetry.metadata()
    ctx.settle(served(status, code))
    return JSONResponse(body, status_code=status, headers=headers)


def with_member(encoded: bytes, name: str, value: Any) -> bytes:
    """``encoded`` (a JSON object's text, ``{...}``) with ``name``: ``value`` as its last member,
    copied once (a 42 MB body in ~40 ms, where a decode and an encode took ~1 s)."""
    member = json.dumps({name: value}, separators=(",", ":"), allow_nan=False).encode()  # as JSONResponse
    return b"".join((memoryview(encoded)[:-1], b",", memoryview(member)[1:]))


async def kept(ctx: Context, response: dict | None) -> None:
    """Store a Responses answer (``ctx.keep``); its size goes on the request's record. A client that
    leaves during the write does not stop it (the database's thread goes on, and the response is
    stored): the record waits for it (``even_if_left``)."""
    ctx.note_stored(await even_if_left(ctx, ctx.keep(response), ctx.note_stored, STORE_WAIT_S))


def stream(ctx: Context) -> RelayedStream:
    """The client's streaming response; however it ends, the request settles (a client gone before
    the first byte included)."""
    link = ClientLink()
    # The trace id goes in the head: a stream that fails never sends the pg_metadata that has it.
    return RelayedStream(
        events(ctx, link), link=link, media_type="text/event-stream",
        headers={**ctx.headers, **ctx.telemetry.trace_headers()},
        on_end=lambda: ctx.settle(abandoned()), stall_timeout_s=ctx.services.stall_timeout_s,
    )


async def events(ctx: Context, link: ClientLink | None = None) -> AsyncIterator[bytes]:
    """The stream's bytes as the client gets them: the replica's, then the closing (or an error
    event); the request settles when they end, or when the client stops reading them. A stream
    whose engine fails mid-answer goes on from another replica where it can (``resume.py``): the
    client sees one stream.

    With the hand-off on (``router.hand_off_streams``), a replica on this node gets the client's
    connection (``link.socket``, once the response's head is written) and writes its bytes there
    itself (``wire/handoff.py``); only its first write comes here too, and, if its engine fails,
    what it wrote."""
    dialect = ctx.surface.dialect
    opening = bytearray()  # the stream's bytes until its first event is whole
    first: dict | None = None  # the first event: the timing chunk reuses its id
    relayed = bytearray() if ctx.resumer is not None and ctx.resumer.keeps_bytes else None
    sequence = dialect.sequence_watch()  # Responses: an error event goes on with the numbering
    output = FirstOutput(ctx.surface.name)  # TTFT: when the first output passes
    link = link or ClientLink()
    try:
        while True:
            client = link.idle_socket() if ctx.services.hand_off else None
            link.handed = ctx.call.present(client, keep=relayed is not None or sequence.reads,
                                           stall_s=ctx.services.stall_timeout_s)
            reader = ctx.call.reader
            while data := await reader.read(READ_BYTES):
                if not output.passed and output.saw(data):
                    ctx.record.mark_first_chunk()
                if first is None:
                    opening += data
                    first = first_event(bytes(opening))
                if link.handed:
                    continue  # the replica's copy of its first write: the client has it already
                if relayed is not None:
                    relayed += data  # read again only if the stream is resumed
                sequence.saw(data)
                yield data
            trailer = await ctx.call.trailer()  # the handle's last item: the engine is done
            if link.handed:  # the router saw its first write only: a resumed call's first is no TTFT
                output.passed = True  # (unmarked: ``compute_split`` falls back to server − decode)
            link.handed = False  # every byte the replica wrote is in the kernel: the router writes again
            ctx.note_trailer(trailer)
            if trailer.written:  # a handed-over stream cut short: what its client has
                if relayed is not None:
                    relayed += trailer.written
                sequence.saw(trailer.written)
            if trailer.client_gone:  # the replica found the client gone, or not reading
                ctx.settle(abandoned())
                raise ClientStalled
            if trailer.complete:
                break
            if ctx.resumer is None or not await ctx.resumer.resume(trailer, bytes(relayed or b"")):
                raise StreamBrokeOff(trailer.error_code)
        if ctx.resumer is not None and ctx.resumer.done and ctx.surface.name == "responses":
            trailer = seam.as_first_told(trailer, ctx.body.get("max_output_tokens"), first)
        # The status line said 200; a stream that ended with an error event is counted as what it was.
        status = trailer.error_status or 200
        if ctx.keep is not None and not trailer.error_status:
            await kept(ctx, trailer.response)
        ctx.telemetry.finish(status, trailer.error_code)
        client_wants_usage = bool((ctx.body.get("stream_options") or {}).get("include_usage"))
        yield dialect.closing(
            ctx.telemetry.metadata(), chunk_object=ctx.surface.chunk_object, first=first or {}, model=ctx.model,
            usage=trailer.usage if client_wants_usage else None, terminal=trailer.terminal,
            failed=trailer.error_status is not None,
        )
        ctx.settle(served(status, trailer.error_code))
    except ClientStalled:
        raise  # the response cuts the connection
    except Exception as err:
        # The status line is sent already: end the stream with an error event, never a hang.
        if isinstance(err, StreamBrokeOff) and err.code == ENGINE_UNAVAILABLE:
            # The request's own id too: a caller chooses its trace id (traceparent), and may reuse it.
            logger.warning("stream %s (trace %s): the model engine died mid-stream", ctx.id, ctx.telemetry.trace_id)
            status, error = 503, engine_failed_mid_stream()
        else:
            logger.exception("stream %s (trace %s) from the model replica failed", ctx.id, ctx.telemetry.trace_id)
            status, error = 500, error_body(500, "the model replica failed mid-stream", code="stream_failed")
        ctx.settle(failed(status, error["error"]["code"]))
        yield dialect.error_event(status, error, sequence_number=sequence.next)
    finally:
        ctx.call.hang_up()  # for a client that left, the replica's cue to stop
        ctx.settle(abandoned())  # a client gone mid-stream; after any other ending, nothing
