"""The router's half of one inference request: call the model replica, relay its answer, and
account for the time (trace spans, metrics, the timing returned to the client).

The replica answers over a Serve streaming handle that carries control only: first a *head*
(``{"status", "body", "stream"}``), and last a *trailer* (engine timing, usage, finish reasons;
serve_app/engine/trailer.py). A stream's SSE bytes do not cross the handle: the head names the
replica's stream listener and a ticket, the router connects to it (``open_byte_stream``) and
relays what each socket read returns to the client as one write — several tokens at once when
the client or the router is behind, never held for a timer (serve_app/engine/stream_server.py).
The router turns the trailer into the final ``event: pg_metadata`` of a stream, or the
``Server-Timing`` header and ``pg_metadata`` field of a JSON response, and draws the request's
spans from the same numbers.
"""

import asyncio
import contextvars
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serve_app.engine.stream_server import CONNECT_TIMEOUT_S, keep_alive
from serve_app.engine.trailer import ENGINE_UNAVAILABLE, engine_failed_mid_stream
from serve_app.errors import APIError, error_body, retry_later
from serve_app.router import dialects
from serve_app.telemetry import tracing
from serve_app.telemetry.metrics import observe
from serve_app.telemetry.timing import RequestRecord, pg_metadata, server_timing_header, sse_data
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the response ended
# 503 codes that mean a replica (not the model's load) failed: its engine died, or it vanished.
REPLICA_FAILURES = (ENGINE_UNAVAILABLE, "replica_unavailable")
READ_BYTES = 64 * 1024  # one socket read: whatever the replica has written, up to this much


class StreamBrokeOff(Exception):
    """The replica's trailer says its stream ended before the engine finished (``code``: why)."""

    def __init__(self, code: str | None):
        super().__init__(f"the replica's stream ended before the engine finished ({code or 'connection lost'})")
        self.code = code


class Exchange:
    """One request's telemetry: its record, its SERVER span, finished exactly once."""

    def __init__(self, route: str, headers, *, region: str, replica: str):
        self.id = uuid.uuid4().hex  # the request's usage record id: written once, however often replayed
        self.record = RequestRecord.begin(route, region=region, replica=replica)
        self.trace = tracing.start_server_span(self.record, headers)
        self.split = None
        self.failover_span = None
        self.generated: dict[str, int] | None = None  # the engine's own token count (trailer)
        self.relay_started = False  # relay_events ran (its finally accounts for the stream)
        # Called once when the request is over, with this exchange: its usage record. Set once
        # the request is admitted; None when another region serves (and bills) it.
        self.bill: Callable[["Exchange"], None] | None = None
        self._release_slot: Callable[[], None] = lambda: None

    def hold_slot(self, release: Callable[[], None]) -> None:
        """Uncount the request from the model's in-flight count when the local call is over."""
        self._release_slot = release

    def start_failover(self, reason: str) -> dict[str, str]:
        """Open the ``failover`` CLIENT span; the headers carry it to the peer (one trace)."""
        self._release_slot()  # the local model is done with it
        self.record.failover_reason = reason
        self.failover_span = tracing.start_failover_span(self.trace, reason)
        return tracing.propagation_headers(self.failover_span)

    def note_failover(self, forwarded) -> None:
        """What the forwarder did: every attempt, and the region that answered (if any)."""
        self.record.failover_region = forwarded.region
        tracing.note_failover_attempts(self.failover_span, forwarded.attempts, forwarded.region)

    def forwarded_done(self, status: int, error_type: str | None) -> None:
        """The peer's answer has been relayed to the end (or broke off): account for the request."""
        self.finish(status, error_type)
        self.close()

    def note_handle_wait(self, waited_ms: float, replica_ms: float | None) -> None:
        """Time from the handle call to the head, less the replica's own work before the head:
        Serve's queue for a free replica slot plus the two handle hops (see ``RequestRecord``)."""
        self.record.note_router_queue(waited_ms - (replica_ms or 0.0))

    def note_trailer(self, trailer: dict[str, Any] | None) -> None:
        if trailer:
            self.generated = trailer.get("generated") or self.generated
            self.record.note_engine(
                trailer.get("engine_timing"),
                usage=trailer.get("usage"),
                finish_reasons=trailer.get("finish_reasons"),
                replica=trailer.get("replica"),
            )

    def finish(self, status: int, error_type: str | None = None):
        """Stop the clock; the first call wins (a later ``finally`` changes nothing)."""
        if self.split is None:
            self.split = self.record.finish(status, error_type)
        return self.split

    @contextmanager
    def failures_recorded(self) -> Iterator[None]:
        """Around everything before a response is built: a refusal (its status and code), a client
        that left (499) or a bug (500) is recorded and the spans end; the exception goes on."""
        try:
            yield
        except APIError as err:
            self.fail(err.status, err.code)
            raise
        except asyncio.CancelledError:  # the client left before the model answered
            self.fail(CLIENT_CLOSED, "client_closed")
            raise
        except Exception:
            self.fail(500, "internal")
            raise

    def fail(self, status: int, error_type: str) -> None:
        """The request ended before a response was built: record why, end the spans."""
        self.finish(status, error_type)
        self.close()

    def close(self) -> None:
        """End the spans and record the metrics; safe to call more than once."""
        self._release_slot()
        if self.trace.split is None:
            split = self.finish(self.record.status)
            if self.failover_span is not None and self.failover_span.is_recording():
                tracing.end_failover_span(self.failover_span, self.record, split)
            tracing.finish_request_spans(self.trace, split)
            observe(self.record, split)
        if self.bill is not None:
            bill, self.bill = self.bill, None
            bill(self)

    def metadata(self) -> dict[str, Any]:
        return pg_metadata(self.record, self.split, self.trace.trace_id)


async def call_model(handle: DeploymentHandle, method: str, body: dict[str, Any], region: str, exchange: Exchange):
    """Start the call and wait for the head; load shedding and dead replicas become 503s.

    ``handle`` is already ``options(stream=True)`` (made once per router replica, not per call).
    """
    called = time.perf_counter()
    stream = detached_from_request(lambda: getattr(handle, method).remote(body))
    try:
        head = await stream.__anext__()
        exchange.note_handle_wait((time.perf_counter() - called) * 1000, head.get("replica_ms"))
    except asyncio.CancelledError:  # the client left before the head: the engine may stop
        stream.cancel()
        raise
    except BackPressureError:
        raise retry_later(f"{body['model']} is at capacity in region {region}", "overloaded") from None
    except RayActorError:
        logger.exception("model replica for %s died", body["model"])
        raise retry_later(f"{body['model']} replica became unavailable", "replica_unavailable") from None
    if head["status"] == 503:  # the replica's engine died (engine_unavailable): another may serve
        error = head["body"]["error"]
        raise retry_later(error["message"].removesuffix("; retry"), error["code"] or "unavailable")
    return stream, head


def detached_from_request(call: Callable[[], Any]) -> Any:
    """Make a handle call that Serve does not cancel with the request that made it.

    Serve cancels every handle call a request made, queued or running, when that request is
    cancelled — as the router's is when its client disconnects. A stream's call must outlive its
    client: the replica stops the engine on the router's hang-up and still ends the call with the
    trailer, whose token count bills the request (``settle_abandoned``). So the call is made under
    a copy of Serve's request context with an internal id of its own (Serve files child calls
    under the parent's internal id), keeping the request id its logs and traces use. Every path
    that gives up on the call cancels it itself: a client gone before the head (``call_model``),
    a listener that cannot be reached (``open_byte_stream``), a trailer that never comes.

    Serve's request context is private API (``ray.serve.context``, Ray 2.60 as pinned);
    ``tests/unit/test_byte_stream.py`` holds it to what this relies on.
    """
    current = serve_context._get_serve_request_context()
    own = dataclasses.replace(
        current, _internal_request_id=str(uuid.uuid4()), cancel_on_parent_request_cancel=False
    )
    context = contextvars.copy_context()
    context.run(serve_context._serve_request_context.set, own)
    return context.run(call)


def json_response(head: dict[str, Any], exchange: Exchange, headers: dict[str, str]) -> JSONResponse:
    """A non-stream answer: timing in ``Server-Timing`` and, on success, ``pg_metadata``."""
    exchange.note_trailer(head.get("trailer"))
    status, body = head["status"], head["body"]
    error = body.get("error") if status >= 400 else None
    split = exchange.finish(status, (error or {}).get("code") or (error or {}).get("type"))
    if status < 400:
        body["pg_metadata"] = exchange.metadata()
    exchange.close()
    return JSONResponse(body, status_code=status, headers={**headers, "Server-Timing": server_timing_header(split)})


async def open_byte_stream(stream, head: dict[str, Any], model: str):
    """Connect to the replica's stream listener named in ``head`` and present its ticket.

    Before any byte is sent to the client, so a replica that cannot be reached is still a clean
    503 (which may fail over) and not a broken 200.
    """
    host, port = head["socket"]
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        stream.cancel()
        logger.exception("cannot reach the stream listener of %s at %s:%s", model, host, port)
        raise retry_later(f"{model} replica became unavailable", "replica_unavailable") from None
    except asyncio.CancelledError:  # the client left while connecting: the engine may stop
        stream.cancel()
        raise
    keep_alive(writer)
    writer.write(head["ticket"].encode("ascii") + b"\n")
    return reader, writer


async def relay_events(
    stream,
    socket,
    exchange: Exchange,
    *,
    client_wants_usage: bool = False,
    dialect=dialects.CHAT,
    on_trailer: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> AsyncIterator[bytes]:
    """Relay the replica's SSE bytes per socket read, then the surface's closing (``dialect``:
    ``pg_metadata``, and ``[DONE]`` on chat and completions).

    The trailer comes over the handle once the replica has closed the socket; ``on_trailer`` sees
    a complete stream's trailer before the closing is sent (the Responses store keeps the final
    response it carries). A client that leaves: the router closes the socket, the replica aborts
    the engine request (freeing its KV cache) and still sends its trailer (``settle_abandoned``).
    """
    exchange.relay_started = True
    reader, writer = socket
    opening = bytearray()  # the stream's bytes until its first event is whole
    first: dict[str, Any] = {}  # the first chunk: the pg_metadata event reuses its id
    usage = None
    finished = trailer_read = False
    try:
        while data := await reader.read(READ_BYTES):
            if opening is not None:
                if not opening:
                    exchange.record.mark_first_chunk()
                opening += data
                if b"\n\n" in opening:
                    first = sse_data(opening.split(b"\n\n", 1)[0].decode()) or {}
                    opening = None
            yield data
        trailer = (await stream.__anext__())["trailer"]  # the handle's last item: the engine is done
        trailer_read = True
        exchange.note_trailer(trailer)
        usage = trailer.get("usage")
        if not trailer.get("complete", True):
            raise StreamBrokeOff(trailer.get("error_code"))
        # The status line said 200; a stream that ended with an error event is counted as what it was.
        exchange.finish(trailer.get("error_status") or 200, trailer.get("error_code"))
        if on_trailer is not None and not trailer.get("error_status"):
            await on_trailer(trailer)
        yield dialect.closing(
            exchange.metadata(),
            route=exchange.record.route,
            first=first,
            model=exchange.record.model,
            usage=usage if client_wants_usage else None,
        )
        finished = True
    except Exception as err:
        # The status line is sent already: end the stream with an error event, never a hang.
        if isinstance(err, StreamBrokeOff) and err.code == ENGINE_UNAVAILABLE:
            logger.warning("stream %s: the model engine died mid-stream", exchange.trace.trace_id)
            status, error = 503, engine_failed_mid_stream()
        else:
            logger.exception("stream %s from the model replica failed", exchange.trace.trace_id)
            status, error = 500, error_body(500, "the model replica failed mid-stream", code="stream_failed")
        exchange.finish(status, error["error"]["code"])
        yield dialect.error_event(status, error)
        finished = True
    finally:
        writer.close()  # for a client that left, the replica's cue to stop (stream_server.pump)
        if not finished:
            exchange.finish(CLIENT_CLOSED, "client_closed")
        if trailer_read:
            exchange.close()
        else:  # the client left, or the socket broke: the trailer still has the token count
            settle_abandoned(stream, exchange)


# How long a stream the client left may take to send its trailer (the replica stops at once on the
# hang-up; this bounds a replica that cannot). Past it the call is cancelled, billed as counted.
ABANDONED_TRAILER_WAIT_S = 10.0
_settling: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


def abandon_unrelayed(stream, socket, exchange: Exchange) -> None:
    """The response ended before its relay started (the client left at once): hang up, and
    account for the stream as ``relay_events`` would have."""
    if exchange.relay_started:
        return
    exchange.relay_started = True
    socket[1].close()
    exchange.finish(CLIENT_CLOSED, "client_closed")
    settle_abandoned(stream, exchange)


async def wait_settled() -> None:
    """Until every abandoned stream's trailer is in (or given up on): before the router stops,
    so their usage records are queued while the ledger can still write them."""
    if _settling:
        await asyncio.gather(*_settling, return_exceptions=True)


def settle_abandoned(stream, exchange: Exchange) -> None:
    """Account for a stream whose client left, in the background: the replica aborts the engine
    request when the router hangs up and still ends the handle call with a trailer, whose token
    count is what the request cost. Then the request's spans end and it is billed."""

    async def settle() -> None:
        try:
            item = await asyncio.wait_for(stream.__anext__(), ABANDONED_TRAILER_WAIT_S)
            exchange.note_trailer(item.get("trailer"))
        except Exception as err:  # no trailer in time, or the replica died: bill what is known
            logger.warning("stream %s: no trailer after it ended early (%r)", exchange.trace.trace_id, err)
            stream.cancel()
        finally:
            exchange.close()

    task = asyncio.get_running_loop().create_task(settle())
    _settling.add(task)
    task.add_done_callback(_settling.discard)
