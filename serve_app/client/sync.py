"""``Client``: the synchronous twin of ``AsyncClient``, for scripts and notebooks.

It runs an ``AsyncClient`` on a private event loop in one daemon thread and waits for each call.
One implementation of retries, failover, auth and stream parsing serves both clients, so they
cannot drift apart; and because the loop is its own, the sync client works where the caller's
thread already runs a loop (Jupyter), where ``asyncio.run`` would refuse.
"""

import asyncio
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

from serve_app.client import resources
from serve_app.client.client import AsyncClient
from serve_app.client.errors import ServeAppError
from serve_app.client.streams import AsyncStream
from serve_app.client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    CreateEmbeddingResponse,
    Message,
    MessageStreamEvent,
    MessageTokensCount,
    Model,
    ModelList,
    Response,
    ResponseDeleted,
    ResponseStreamEvent,
)

T = TypeVar("T")
_END = object()


class _Loop:
    """An event loop running forever in a daemon thread; ``run`` waits for one coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="serve_app-client", daemon=True)
        self.thread.start()
        # Once nothing holds this loop any more (the client, its groups and streams all dropped
        # without close(): a client re-created in a notebook cell), its thread stops.
        self._finalizer = weakref.finalize(self, _stop_loop, self.loop, self.thread)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.loop.is_closed():
            coro.close()  # never started: no "coroutine was never awaited" warning
            raise ServeAppError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt in the caller's thread: stop the work too
            future.cancel()
            raise

    def stop(self) -> None:
        self._finalizer()  # once: later calls, and the collection, do nothing


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(loop.stop)
    if threading.current_thread() is thread:  # collected on the loop's own thread: it stops after this turn
        return
    thread.join()
    loop.close()


class Stream(Generic[T]):
    """A sync iterator over an ``AsyncStream``; ``timing``, ``region``, ``trace_id`` as there."""

    def __init__(self, stream: AsyncStream[Any], loop: _Loop):
        self._stream, self._loop = stream, loop

    def __repr__(self) -> str:
        return repr(self._stream).replace("AsyncStream", "Stream", 1)

    def __getattr__(self, name: str) -> Any:  # timing, region, trace_id, ended, headers
        return getattr(self._stream, name)

    def __iter__(self) -> "Stream[T]":
        return self

    def __next__(self) -> T:
        chunk = self._loop.run(_next_or_end(self._stream))
        if chunk is _END:
            raise StopIteration
        return chunk

    def start(self) -> "Stream[T]":
        self._loop.run(self._stream.start())
        return self

    def close(self) -> None:
        self._loop.run(self._stream.aclose())

    def __enter__(self) -> "Stream[T]":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SyncGroup:
    """The sync view of one of ``AsyncClient``'s API groups (``resources.py``)."""

    def __init__(self, group: Any, loop: _Loop):
        self._group, self._loop = group, loop

    def _stream(self, method: Any, request: dict[str, Any] | None, params: dict[str, Any]) -> "Stream[Any]":
        return Stream(self._loop.run(_on_loop(method, request, **params)), self._loop)


class Responses(_SyncGroup):
    """``client.responses`` of ``Client``: ``resources.Responses`` without ``await``."""

    _group: resources.Responses

    def create(self, request: dict[str, Any] | None = None, /, **params: Any) -> Response:
        return self._loop.run(self._group.create(request, **params))

    def stream(self, request: dict[str, Any] | None = None, /, **params: Any) -> Stream[ResponseStreamEvent]:
        return self._stream(self._group.stream, request, params)

    def retrieve(self, response_id: str, *, timeout: resources.Timeout = None) -> Response:
        return self._loop.run(self._group.retrieve(response_id, timeout=timeout))

    def delete(self, response_id: str, *, timeout: resources.Timeout = None) -> ResponseDeleted:
        return self._loop.run(self._group.delete(response_id, timeout=timeout))


class Messages(_SyncGroup):
    """``client.messages`` of ``Client``: ``resources.Messages`` without ``await``."""

    _group: resources.Messages

    def create(self, request: dict[str, Any] | None = None, /, **params: Any) -> Message:
        return self._loop.run(self._group.create(request, **params))

    def stream(self, request: dict[str, Any] | None = None, /, **params: Any) -> Stream[MessageStreamEvent]:
        return self._stream(self._group.stream, request, params)

    def count_tokens(self, request: dict[str, Any] | None = None, /, **params: Any) -> MessageTokensCount:
        return self._loop.run(self._group.count_tokens(request, **params))


async def _next_or_end(stream: AsyncStream[Any]) -> Any:
    # StopAsyncIteration must not cross the thread boundary as an exception of a Future.
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return _END


class Client:
    """Same arguments and methods as ``AsyncClient``, without ``await``."""

    def __init__(self, api_key: str | None = None, **options: Any):
        """No network here, as ``AsyncClient(...)``: the token is minted on the first request."""
        self._start(api_key, options, exchange=False)

    @classmethod
    def create(cls, api_key: str | None = None, **options: Any) -> "Client":
        """Like ``AsyncClient.create``: the key is exchanged for a token before this returns."""
        client = cls.__new__(cls)
        client._start(api_key, options, exchange=True)
        return client

    def _start(self, api_key: str | None, options: dict[str, Any], *, exchange: bool) -> None:
        self._loop = _Loop()
        try:
            self._client: AsyncClient = self._loop.run(_make(api_key, options, exchange=exchange))
        except BaseException:
            self._loop.stop()
            raise
        self.responses = Responses(self._client.responses, self._loop)
        self.messages = Messages(self._client.messages, self._loop)
        self.embeddings = Embeddings(self._client.embeddings, self._loop)

    def __repr__(self) -> str:
        return repr(self._client).replace("AsyncClient", "Client", 1)

    base_urls = property(lambda self: self._client.base_urls)
    auth_mode = property(lambda self: self._client.auth_mode)
    token_expires_in = property(lambda self: self._client.token_expires_in)

    def chat_completion(self, request: dict[str, Any] | None = None, /, **params: Any) -> ChatCompletion:
        return self._loop.run(self._client.chat_completion(request, **params))

    def chat_completion_stream(self, request: dict[str, Any] | None = None, /, **params: Any) -> Stream[ChatCompletionChunk]:
        return Stream(self._loop.run(_on_loop(self._client.chat_completion_stream, request, **params)), self._loop)

    def completion(self, request: dict[str, Any] | None = None, /, **params: Any) -> Completion:
        return self._loop.run(self._client.completion(request, **params))

    def completion_stream(self, request: dict[str, Any] | None = None, /, **params: Any) -> Stream[CompletionChunk]:
        return Stream(self._loop.run(_on_loop(self._client.completion_stream, request, **params)), self._loop)

    def models(self, **options: Any) -> ModelList:
        return self._loop.run(self._client.models(**options))

    def model(self, name: str, **options: Any) -> Model:
        return self._loop.run(self._client.model(name, **options))

    def close(self) -> None:
        """Close the connections and stop the client's thread; a second call does nothing."""
        if self._loop.loop.is_closed():
            return
        try:
            self._loop.run(self._client.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Embeddings(_SyncGroup):
    """``client.embeddings.create(...)``, as ``AsyncClient.embeddings``."""

    def create(self, request: dict[str, Any] | None = None, /, **params: Any) -> CreateEmbeddingResponse:
        return self._loop.run(self._group.create(request, **params))


async def _on_loop(make_stream: Any, *args: Any, **kwargs: Any) -> AsyncStream[Any]:
    # Made on the loop thread: the client's set of open streams is only ever touched there.
    return make_stream(*args, **kwargs)


async def _make(api_key: str | None, options: dict[str, Any], *, exchange: bool) -> AsyncClient:
    """Build the AsyncClient inside the loop it will run on (its locks and pool belong to it)."""
    return await AsyncClient.create(api_key, **options) if exchange else AsyncClient(api_key, **options)
