"""The client's three kinds of call, shared by every API group (``AsyncClient``'s own methods,
``resources.py``, ``embeddings.py``): a JSON answer (``create``), a bodiless call (``fetch``:
``GET``, ``DELETE``) and a stream (``stream``). Each is authenticated, retried, failed over and
timed by the transport (``transport.py``); only the route, the result type and, for a stream,
how it ends (``streams.Protocol``) differ. Adding an API group is one class that holds a
``Calls`` — it never reaches into the client.
"""

import weakref
from typing import Any

import httpx

from serve_app.client import types
from serve_app.client.errors import ServeAppError
from serve_app.client.streams import CHAT, AsyncStream, Protocol
from serve_app.client.timing import new_traceparent, server_timing, trace_id_of
from serve_app.client.transport import Sent, Transport, json_object


class Calls:
    def __init__(self, transport: Transport):
        self._transport = transport
        # The streams not yet ended, so that closing the client ends them.
        self._streams: "weakref.WeakSet[AsyncStream[Any]]" = weakref.WeakSet()

    async def create(self, path: str, result_type, request: dict[str, Any] | None, params: dict[str, Any]):
        """POST ``request`` (and ``params``, which win) to ``path``; the typed, timed answer."""
        options = _options(params, self._transport.trace_sample_ratio)
        sent: Sent = await self._send(path, _body(request, params, stream=False), options, stream=False)
        return _timed(path, result_type, sent)

    async def fetch(self, method: str, path: str, result_type, *, timeout: httpx.Timeout | float | None = None):
        """A bodiless call (``GET``, ``DELETE``), retried and failed over like the others."""
        sent = await self._transport.send(method, path, timeout=timeout)
        return _timed(path, result_type, sent)

    def stream(
        self, path: str, chunk_type, request: dict[str, Any] | None, params: dict[str, Any], protocol: Protocol = CHAT
    ) -> AsyncStream[Any]:
        """The stream of ``path``'s answer; nothing is sent before it is first read."""
        options = _options(params, self._transport.trace_sample_ratio)
        body = _body(request, params, stream=True)
        # A call's own timeout is the caller's word for the whole stream; else an open stream's
        # silence is bounded by the client's stream_read_timeout_s (transport.py).
        silence = None if options.get("timeout") is not None else self._transport.stream_read_timeout_s
        stream: AsyncStream[Any] = AsyncStream(
            lambda: self._send(path, body, options, stream=True), chunk_type, trace_id_of(options["traceparent"]),
            protocol, silence_s=silence,
        )
        self._streams.add(stream)
        return stream

    async def close_streams(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()

    def _send(self, path: str, body: dict[str, Any], options: dict[str, Any], *, stream: bool):
        return self._transport.send(
            "POST", path, body=body, stream=stream, traceparent=options["traceparent"],
            timeout=options.get("timeout"), extra_headers=options.get("extra_headers"),
        )


def _timed(path: str, result_type, sent: Sent):
    """The typed body of a JSON answer, with the server's timing (``pg_metadata`` and
    ``Server-Timing``) as ``.timing`` where the type has one."""
    payload = json_object(sent.response)
    try:
        result = result_type.model_validate(payload)
    except ValueError as err:
        raise ServeAppError(f"{path} answered with an unexpected body: {err}") from None
    if isinstance(result, types.Timed):
        result.stamp(server_timing(sent.response.headers, payload.get("pg_metadata"), trace_id=sent.trace_id))
    return result


def _options(params: dict[str, Any], sample_ratio: float) -> dict[str, Any]:
    """Take the client's own keywords out of ``params`` (the rest is the request body)."""
    options = {name: params.pop(name) for name in ("timeout", "traceparent", "extra_headers") if name in params}
    options["traceparent"] = options.get("traceparent") or new_traceparent(sample_ratio)
    trace_id_of(options["traceparent"])  # a malformed traceparent fails here, before anything is sent
    return options


def _body(request: dict[str, Any] | None, params: dict[str, Any], *, stream: bool) -> dict[str, Any]:
    body = {**(request or {}), **params}
    if body.pop("stream", stream) != stream:
        raise ValueError(f"this method {'streams' if stream else 'does not stream'}; use the "
                         f"{'non-' if stream else ''}stream method instead")
    if stream:
        body["stream"] = True
    return body
