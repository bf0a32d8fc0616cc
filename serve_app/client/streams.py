"""A streamed answer: an async iterator of typed chunks or events, with the server's timing at the end.

The request is sent on first iteration (or ``async with``), so ``client.chat_completion_stream(...)``
can be written straight into ``async for`` as in the model card. Retries and failover happen only
until the status line says 200 (``transport.py``); after that nothing is resent, since the caller
has seen part of the answer.

How the server ends a stream, per API (docs/api.md, "Server timing" and "Errors"; ``Protocol``):
- chat and completions: ``event: pg_metadata`` (a chunk-shaped event carrying the timing), then
  ``data: [DONE]``. The pg_metadata event is not yielded: it becomes ``stream.timing``. (The openai
  SDK yields it as an empty chunk; the usage it repeats was already yielded in its own chunk.)
- Responses: the terminal event (``response.completed`` / ``.incomplete`` / ``.failed``) is
  yielded last; its ``response.pg_metadata`` becomes ``stream.timing`` and its response
  ``stream.response``. No ``[DONE]``.
- Messages: ``message_stop`` is yielded last; its ``pg_metadata`` becomes ``stream.timing``.
  (``ping`` keep-alives are not yielded.)
- failing after the 200: an error event (``data: {"error": {...}}`` then ``[DONE]``; Responses' and
  Anthropic's ``event: error``): raised as a typed error (``during_stream=True``).
- a connection that closes before the stream's end is an ``APIConnectionError``: an answer cut
  short must not look complete.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel

from serve_app.client import sse
from serve_app.client.errors import APIConnectionError, APITimeoutError, ServeAppError, from_stream_event
from serve_app.client.timing import REGION_HEADER, ServerTiming, server_timing
from serve_app.client.transport import Sent
from serve_app.client.types import Timed

Chunk = TypeVar("Chunk", bound=BaseModel)
METADATA_EVENT = "pg_metadata"
DONE = "[DONE]"
RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass(frozen=True)
class Protocol:
    """How one API's stream ends, where it puts the timing, and what it does not yield.

    ``terminal``: the event types that end it (yielded, then the stream is over; empty: it ends
    with ``[DONE]``); ``timing_at``: the keys down to the ``pg_metadata`` of the event that
    carries it; ``typed``: its events name their kind in ``type`` (an ``error`` one is raised);
    ``skipped``: types not yielded."""

    terminal: frozenset[str] = frozenset()
    timing_at: tuple[str, ...] = (METADATA_EVENT,)
    typed: bool = False
    skipped: frozenset[str] = frozenset()

    def timing_of(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        for key in self.timing_at:
            payload = payload.get(key) if isinstance(payload, dict) else None
        return payload if isinstance(payload, dict) else None


CHAT = Protocol()
RESPONSES = Protocol(terminal=RESPONSES_TERMINAL, timing_at=("response", METADATA_EVENT), typed=True)
MESSAGES = Protocol(terminal=frozenset({"message_stop"}), typed=True, skipped=frozenset({"ping"}))


class AsyncStream(Generic[Chunk]):
    def __init__(self, start: Callable[[], Awaitable[Sent]], chunk_type: type[Chunk], trace_id: str,
                 protocol: Protocol = CHAT, silence_s: float | None = None):
        self._start, self._chunk_type, self._protocol = start, chunk_type, protocol
        self._silence_s = silence_s  # once open, the longest wait for its next event (None: the read timeout's)
        self._sent: Sent | None = None
        self._events: AsyncIterator[sse.Event] | None = None
        self._closed = False
        self.trace_id = trace_id  # known before the request is sent: the client made the traceparent
        self.timing: ServerTiming | None = None  # set when the server's timing arrives
        self.ended = False  # True after the stream's end ([DONE], its terminal event), not after an error
        self.last: Chunk | None = None  # Responses: the terminal event (its ``response`` is ``stream.response``)

    def __repr__(self) -> str:
        return f"AsyncStream(trace_id={self.trace_id!r}, region={self.region!r}, ended={self.ended})"

    @property
    def region(self) -> str | None:
        """The region that served (``x-pg-region``), once the response has started."""
        if self._sent is not None and self._sent.response.headers.get(REGION_HEADER):
            return self._sent.response.headers[REGION_HEADER]
        return self.timing.region if self.timing else None

    @property
    def headers(self) -> httpx.Headers | None:
        return self._sent.response.headers if self._sent else None

    @property
    def response(self) -> Any:
        """Responses: the final response (the terminal event's), with ``.timing``; None before."""
        return getattr(self.last, "response", None) if self.ended else None

    async def start(self) -> "AsyncStream[Chunk]":
        """Send the request and wait for its status line (retrying and failing over until then)."""
        if self._sent is None and not self._closed:
            self._sent = await self._start()
            self._events = sse.events(self._sent.response)
        return self

    async def aclose(self) -> None:
        """Close the connection; call it (or use ``async with``) when leaving a stream early."""
        self._closed = True
        if self._sent is not None:
            await self._sent.response.aclose()

    async def __aenter__(self) -> "AsyncStream[Chunk]":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> "AsyncStream[Chunk]":
        return self

    async def __anext__(self) -> Chunk:
        if self.ended:
            await self.aclose()
            raise StopAsyncIteration
        if self._closed:  # by another task or thread (a shutdown's close): cut short, never complete
            raise APIConnectionError("the stream was closed before its end: the answer is incomplete",
                                     region=self.region, trace_id=self.trace_id)
        await self.start()
        assert self._events is not None
        try:
            while True:
                try:
                    async with asyncio.timeout(self._silence_s):  # None: no bound of its own
                        event = await anext(self._events)
                except StopAsyncIteration:
                    end = "its terminal event" if self._protocol.terminal else "[DONE]"
                    raise APIConnectionError(
                        f"the stream ended before {end}: the answer may be incomplete",
                        region=self.region, trace_id=self.trace_id,
                    ) from None
                chunk = self._take(event)
                if chunk is not None:
                    return chunk
                if self.ended:
                    await self.aclose()
                    raise StopAsyncIteration
        except (httpx.TimeoutException, TimeoutError):  # httpx's read timeout, or ``silence_s``
            await self.aclose()
            raise APITimeoutError("the stream stalled past the read timeout", region=self.region, trace_id=self.trace_id) from None
        except (httpx.HTTPError, httpx.StreamError) as err:  # a broken line, a bad encoding, a close meanwhile
            closed_meanwhile = self._closed
            await self.aclose()
            why = "was closed before its end" if closed_meanwhile else f"broke off: {type(err).__name__}"
            raise APIConnectionError(f"the stream {why}", region=self.region, trace_id=self.trace_id) from None
        except ServeAppError:
            await self.aclose()
            raise

    def _take(self, event: sse.Event) -> Chunk | None:
        """The chunk an event carries, or None (chat's timing, [DONE], skipped types, non-JSON
        keep-alives)."""
        protocol = self._protocol
        if event is sse.KEEP_ALIVE:  # read, so the silence bound starts again (``__anext__``)
            return None
        if event.data.strip() == DONE:
            self.ended = self.ended or not protocol.terminal
            return None
        try:
            payload: Any = json.loads(event.data)
        except json.JSONDecodeError:
            return None
        if not isinstance(payload, dict):
            return None
        kind = payload.get("type") if protocol.typed else None
        if kind == "error" or ("error" in payload and "choices" not in payload and not protocol.typed):
            raise from_stream_event(payload, region=self.region, trace_id=self.trace_id)
        if kind in protocol.skipped:
            return None
        if not protocol.typed and (event.event == METADATA_EVENT or METADATA_EVENT in payload):
            self.timing = self._timing(protocol.timing_of(payload))
            return None
        try:
            chunk = self._chunk_type.model_validate(payload)
        except ValueError as err:  # pydantic's ValidationError: the caller's loop gets ours (closed, below)
            raise ServeAppError(f"the stream sent an event this client cannot read: {err}") from None
        if kind in protocol.terminal:
            self.timing, self.ended, self.last = self._timing(protocol.timing_of(payload)), True, chunk
            if isinstance(getattr(chunk, "response", None), Timed):
                chunk.response.stamp(self.timing)
        return chunk

    def _timing(self, metadata: dict[str, Any] | None) -> ServerTiming:
        headers = self._sent.response.headers if self._sent else httpx.Headers()
        return server_timing(headers, metadata, trace_id=self.trace_id)
