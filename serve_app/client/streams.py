"""A streamed completion: an async iterator of typed chunks, with the server's timing at the end.

The request is sent on first iteration (or ``async with``), so ``client.chat_completion_stream(...)``
can be written straight into ``async for`` as in the model card. Retries and failover happen only
until the status line says 200 (``transport.py``); after that nothing is resent, since the caller
has seen part of the answer.

How the server ends a stream (docs/api.md, "Server timing" and "Errors"):
- normally: ``event: pg_metadata`` (a chunk-shaped event carrying the timing), then ``data: [DONE]``.
  The pg_metadata event is not yielded: it becomes ``stream.timing``. (The openai SDK yields it as
  an empty chunk; the usage it repeats was already yielded in its own chunk.)
- failing after the 200: ``data: {"error": {...}}`` then ``[DONE]``: raised as a typed error
  (``during_stream=True``).
- a connection that closes before ``[DONE]`` is an ``APIConnectionError``: an answer cut short must
  not look complete.
"""

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel

from serve_app.client import sse
from serve_app.client.errors import APIConnectionError, APITimeoutError, ServeAppError, from_stream_event
from serve_app.client.timing import REGION_HEADER, ServerTiming, server_timing
from serve_app.client.transport import Sent

Chunk = TypeVar("Chunk", bound=BaseModel)
METADATA_EVENT = "pg_metadata"
DONE = "[DONE]"


class AsyncStream(Generic[Chunk]):
    def __init__(self, start: Callable[[], Awaitable[Sent]], chunk_type: type[Chunk], trace_id: str):
        self._start, self._chunk_type = start, chunk_type
        self._sent: Sent | None = None
        self._events: AsyncIterator[sse.Event] | None = None
        self._closed = False
        self.trace_id = trace_id  # known before the request is sent: the client made the traceparent
        self.timing: ServerTiming | None = None  # set when the server's pg_metadata event arrives
        self.ended = False  # True after [DONE] (not after an error or an early close)

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
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        assert self._events is not None
        try:
            while True:
                try:
                    event = await anext(self._events)
                except StopAsyncIteration:
                    raise APIConnectionError(
                        "the stream ended before [DONE]: the answer may be incomplete",
                        region=self.region, trace_id=self.trace_id,
                    ) from None
                chunk = self._take(event)
                if chunk is not None:
                    return chunk
                if self.ended:
                    await self.aclose()
                    raise StopAsyncIteration
        except httpx.TimeoutException:
            await self.aclose()
            raise APITimeoutError("the stream stalled past the read timeout", region=self.region, trace_id=self.trace_id) from None
        except httpx.TransportError as err:
            await self.aclose()
            raise APIConnectionError(f"the stream broke off: {type(err).__name__}", region=self.region, trace_id=self.trace_id) from None
        except ServeAppError:
            await self.aclose()
            raise

    def _take(self, event: sse.Event) -> Chunk | None:
        """The chunk an event carries, or None (timing, [DONE], non-JSON keep-alives)."""
        if event.data.strip() == DONE:
            self.ended = True
            return None
        try:
            payload: Any = json.loads(event.data)
        except json.JSONDecodeError:
            return None
        if not isinstance(payload, dict):
            return None
        if "error" in payload and "choices" not in payload:
            raise from_stream_event(payload, region=self.region, trace_id=self.trace_id)
        if event.event == METADATA_EVENT or METADATA_EVENT in payload:
            headers = self._sent.response.headers if self._sent else httpx.Headers()
            self.timing = server_timing(headers, payload.get(METADATA_EVENT), trace_id=self.trace_id)
            return None
        return self._chunk_type.model_validate(payload)
