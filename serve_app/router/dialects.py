"""How a stream ends, and how an error looks, on each API surface the router relays.

The relay (``relay.py``) is the same for every surface: the replica's SSE bytes go through as they
are; the router adds one timing event after them, or an error event when the stream breaks. What
those two look like is the surface's:

- OpenAI chat and completions: ``event: pg_metadata`` shaped like a chunk of the stream, then
  ``data: [DONE]``; an error is ``data: {"error": {...}}`` then ``[DONE]``;
- OpenAI Responses: ``event: pg_metadata`` with ``{"type": "pg_metadata", "pg_metadata": …}``
  after ``response.completed``, and no ``[DONE]`` (OpenAI sends none); an error is OpenAI's
  ``event: error`` (``{"type": "error", "code", "message", "param"}``);
- Anthropic Messages: the same timing event after ``message_stop``; an error is Anthropic's
  ``event: error`` (``{"type": "error", "error": {"type", "message"}}``), and every error body on
  its routes is in that shape too (``anthropic_error``).
"""

import json
from typing import Any

from fastapi.responses import JSONResponse

from serve_app.engine import anthropic_shape
from serve_app.engine.sse import data_event, named_event
from serve_app.errors import APIError
from serve_app.telemetry.timing import PG_METADATA_EVENT, pg_metadata_event

DONE = b"data: [DONE]\n\n"


class ChatDialect:
    """Chat and completions (``pg_metadata_event`` keeps the openai SDK's chunk loops working)."""

    def closing(self, metadata: dict[str, Any], *, route: str, first: dict[str, Any], model: str | None, usage) -> bytes:
        event = pg_metadata_event(
            metadata, route=route, chunk_id=first.get("id"), created=first.get("created"), model=model, usage=usage
        )
        return event.encode() + DONE

    def error_event(self, status: int, error: dict[str, Any]) -> bytes:
        return data_event(error).encode() + DONE


class TypedEventDialect:
    """Responses and Messages: every event names its ``type``; the timing event is one more."""

    def __init__(self, anthropic: bool):
        self.anthropic = anthropic

    def closing(self, metadata: dict[str, Any], **_: Any) -> bytes:
        payload = {"type": PG_METADATA_EVENT, "pg_metadata": dict(metadata)}
        return named_event(PG_METADATA_EVENT, payload).encode()

    def error_event(self, status: int, error: dict[str, Any]) -> bytes:
        inner = error["error"]
        if self.anthropic:
            return anthropic_shape.error_event(status, inner["message"]).encode()
        payload = {"type": "error", "code": inner.get("code"), "message": inner["message"], "param": inner.get("param")}
        return named_event("error", payload).encode()


CHAT = ChatDialect()
RESPONSES = TypedEventDialect(anthropic=False)
MESSAGES = TypedEventDialect(anthropic=True)

def anthropic_error(err: APIError) -> JSONResponse:
    """An ``APIError`` as Anthropic's error body, with the same status and headers."""
    return JSONResponse(anthropic_shape.error_body(err.status, err.message), status_code=err.status, headers=err.headers)


def anthropic_errors_only(response: Any) -> Any:
    """A JSON error from the replica or a peer (OpenAI-shaped) rewritten in Anthropic's shape;
    any other response as it is."""
    if not isinstance(response, JSONResponse) or response.status_code < 400:
        return response
    body = json.loads(response.body)
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or body.get("type") == "error":
        return response
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    shaped = anthropic_shape.error_body(response.status_code, str(error.get("message") or "request failed"))
    return JSONResponse(shaped, status_code=response.status_code, headers=headers)
