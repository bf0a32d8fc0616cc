"""The three APIs the surfaces speak, and what differs between them at the router: how an error
looks (a JSON body, or an event inside a stream that has started), how a stream ends, and which
headers carry a credential.

- OpenAI chat and completions (``OPENAI``): a stream ends with ``event: pg_metadata`` shaped like
  a chunk of that stream, then ``data: [DONE]``; an error event is ``data: {"error": {...}}`` then
  ``[DONE]``;
- OpenAI Responses (``RESPONSES``): the terminal event (``response.completed``, ``.incomplete``
  or ``.failed``) is the last one, with the timing as ``response.pg_metadata`` (an extra field of
  the response object, which OpenAI's spec and Open Responses both allow), and no ``[DONE]``
  (OpenAI sends none); an error is OpenAI's ``event: error`` (``{"type": "error", "code",
  "message", "param", "sequence_number"}``) with Open Responses' ``error`` object inside it too;
- Anthropic Messages (``ANTHROPIC``): ``message_stop`` is the last event, with the timing as its
  ``pg_metadata`` field (the spec allows extra fields; an unknown event type it does not); an
  error is Anthropic's ``event: error`` (``{"type": "error", "error": {"type", "message"}}``),
  every error body on its routes is in that shape too, and ``x-api-key`` is a credential beside
  ``Authorization``.

The relay (``router/relay.py``) passes the replica's SSE bytes through unread; the router adds only
the closing — for Responses and Messages the terminal event the replica held back
(``Trailer.terminal``), now with the timing in it — or an error event when the stream breaks,
whoever breaks it, a peer region included. A Responses error event needs the next
``sequence_number``, which a ``sequence_watch`` finds in the bytes as they pass.
"""

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse, Response

from serve_app.engine import anthropic_shape, responses_shape
from serve_app.errors import APIError
from serve_app.wire.sse import DONE_BYTES, data_event, named_event

PG_METADATA_EVENT = "pg_metadata"
_SEQUENCE_KEY = b'"sequence_number":'
_SEQUENCE_DIGITS = re.compile(rb"\s*(\d+)")
# Enough of one read kept for the next: a key and its number split between two reads.
_SEQUENCE_TAIL = len(_SEQUENCE_KEY) + 24


class SequenceWatch:
    """The next ``sequence_number`` of a Responses stream, read off its bytes as they pass: one
    search per read, nothing parsed. (A quote inside a JSON string is escaped, so the key found
    is always a key.)"""

    reads = True  # a handed-over stream keeps its bytes for this (``wire/handoff.py``)

    def __init__(self) -> None:
        self._last: int | None = None
        self._tail = b""

    def saw(self, data: bytes) -> None:
        text = self._tail + data
        end = len(text)
        while (at := text.rfind(_SEQUENCE_KEY, 0, end)) >= 0:
            digits = _SEQUENCE_DIGITS.match(text, at + len(_SEQUENCE_KEY))
            if digits and digits.end() < len(text):  # a number that may go on in the next read is not read yet
                self._last = int(digits.group(1))
                break
            end = at
        self._tail = text[-_SEQUENCE_TAIL:]

    @property
    def next(self) -> int | None:
        return 0 if self._last is None else self._last + 1


class _NoSequence:
    """For the APIs whose events carry no sequence number."""

    next = None
    reads = False

    def saw(self, data: bytes) -> None:
        pass


_NO_SEQUENCE = _NoSequence()


class OpenAIDialect:
    """Chat and completions (the chunk-shaped timing event keeps the openai SDK's loops working)."""

    api_key_header = False

    def closing(self, metadata: Mapping[str, Any], *, chunk_object: str, first: Mapping[str, Any],
                model: str | None, usage: Mapping[str, Any] | None, failed: bool = False, **_: Any) -> bytes:
        """The timing chunk, then ``[DONE]``; only ``[DONE]`` after a stream that ended with its
        error event (docs/api.md: a failed stream carries no timing)."""
        if failed:
            return DONE_BYTES
        event = pg_metadata_event(
            metadata, chunk_object=chunk_object, chunk_id=first.get("id"), created=first.get("created"),
            model=model, usage=usage,
        )
        return event.encode() + DONE_BYTES

    def error_event(self, status: int, error: dict[str, Any], *, sequence_number: int | None = None) -> bytes:
        return data_event(error).encode() + DONE_BYTES

    def sequence_watch(self) -> "SequenceWatch | _NoSequence":
        return _NO_SEQUENCE

    def error_response(self, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def reshape(self, response: Response) -> Response:
        """A JSON error from a replica or a peer (OpenAI-shaped already): as it is."""
        return response


class TypedEventDialect:
    """Responses and Messages: every event names its ``type``, and the terminal one, last, carries
    the timing."""

    def __init__(self, anthropic: bool):
        self.anthropic = anthropic
        self.api_key_header = anthropic

    def closing(self, metadata: Mapping[str, Any], *, terminal: Mapping[str, Any] | None = None, **_: Any) -> bytes:
        """The terminal event the replica held back, with ``metadata`` inside it; nothing when the
        stream had none (it ended with an error event, which stays the last)."""
        if terminal is None:
            return b""
        if self.anthropic:
            event = {**terminal, PG_METADATA_EVENT: dict(metadata)}
        else:  # a copy: the response itself is the one stored, without timing
            event = {**terminal, "response": {**terminal["response"], PG_METADATA_EVENT: dict(metadata)}}
        return named_event(event["type"], event).encode()

    def error_event(self, status: int, error: dict[str, Any], *, sequence_number: int | None = None) -> bytes:
        """``sequence_number``: the stream's next (``sequence_watch``), for Responses."""
        inner = error["error"]
        if self.anthropic:
            return anthropic_shape.error_event(status, inner["message"]).encode()
        payload: dict[str, Any] = {"type": "error", "code": inner.get("code"), "message": inner["message"],
                                   "param": inner.get("param")}
        payload["error"] = responses_shape.error_object(payload, inner.get("type") or "server_error")
        if sequence_number is not None:
            payload["sequence_number"] = sequence_number
        return named_event("error", payload).encode()

    def sequence_watch(self) -> "SequenceWatch | _NoSequence":
        return _NO_SEQUENCE if self.anthropic else SequenceWatch()

    def error_response(self, err: APIError) -> JSONResponse:
        if not self.anthropic:
            return OPENAI.error_response(err)
        return JSONResponse(anthropic_shape.error_body(err.status, err.message), status_code=err.status, headers=err.headers)

    def reshape(self, response: Response) -> Response:
        """Anthropic's routes: a JSON error from a replica or a peer (OpenAI-shaped) rewritten in
        Anthropic's shape, same status and headers; any other response as it is."""
        if not self.anthropic or not isinstance(response, JSONResponse) or response.status_code < 400:
            return response
        body = json.loads(response.body)
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or body.get("type") == "error":
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        shaped = anthropic_shape.error_body(response.status_code, str(error.get("message") or "request failed"))
        return JSONResponse(shaped, status_code=response.status_code, headers=headers)


Dialect = OpenAIDialect | TypedEventDialect
OPENAI = OpenAIDialect()
RESPONSES = TypedEventDialect(anthropic=False)
ANTHROPIC = TypedEventDialect(anthropic=True)


def pg_metadata_event(
    metadata: Mapping[str, Any],
    *,
    chunk_object: str = "chat.completion.chunk",
    chunk_id: str | None = None,
    created: int | None = None,
    model: str | None = None,
    usage: Mapping[str, Any] | None = None,
) -> str:
    """A chat or completions stream's last event before ``data: [DONE]``, shaped like its chunks.

    The openai SDK yields every SSE event before ``[DONE]`` as a chunk, whatever its ``event:``
    name, so this one carries one choice with an empty delta (chat) or empty text (completions):
    ``chunk.choices[0].delta.content`` is None and loops written for vLLM/OpenAI streams keep
    working. The timing rides along as ``chunk.pg_metadata`` (an extra field the SDK keeps).

    ``usage``: when the caller asked for ``stream_options.include_usage``, pass the usage the
    stream already reported, so code that reads ``chunks[-1].usage`` (OpenAI sends usage on the
    last chunk before ``[DONE]``) still finds it on what is now the last chunk.
    """
    if chunk_object == "text_completion":
        choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": None}
    else:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}
    chunk = {
        "id": chunk_id or f"pgmeta-{metadata.get('trace_id') or 'none'}",
        "object": chunk_object,
        "created": created if created is not None else int(time.time()),
        "model": model or metadata.get("model") or "",
        "choices": [choice],
        "pg_metadata": dict(metadata),
    }
    if usage is not None:
        chunk["usage"] = dict(usage)
    return named_event(PG_METADATA_EVENT, chunk)
