"""Anthropic Messages bodies, stream events and errors as Anthropic's schema has them, from vLLM's.

vLLM's non-stream ``AnthropicMessagesResponse`` is dumped with ``exclude_none=True`` (a plain dump
gives every content block a dozen ``null`` keys), and its stream frames with
``exclude_unset=True``; both leave out what Anthropic's API always sends. Anthropic's published
schema marks every such field *required*, even the nullable ones with a default
(tests/data/schemas/README.md), so strict clients and validators reject vLLM's bodies. Here:

- a required nullable field vLLM left out is added as ``null`` (``stop_sequence``,
  ``stop_details``, ``container``, usage's cache counts, ``inference_geo``,
  ``output_tokens_details``, ``server_tool_use``, ``service_tier``, a text block's ``citations``):
  ``null`` means "not known", which is true, where ``0`` or ``"standard"`` would be invented. The
  one non-null default added is a ``tool_use`` block's ``caller: {"type": "direct"}``: vLLM's tool
  calls are always the model's own, and a thinking block opening a stream gets the empty
  ``signature`` Anthropic sends there (vLLM sends the real one as a ``signature_delta`` later);
- the id gets Anthropic's ``msg_`` prefix instead of vLLM's ``chatcmpl-`` (the rest is kept, so
  logs still match);
- ``kv_transfer_params``/``ec_transfer_params`` are kept only when the request set them;
- errors get Anthropic's ``error.type`` for their HTTP status. vLLM reports OpenAI's names
  (``BadRequestError``…) and, mid-stream, ``internal_error``; neither is in Anthropic's enum.

vLLM's stream yields ready SSE strings. The per-token ``content_block_delta`` frames are returned
as they came (they already validate) after one prefix test; only the few other frames that need a
fix are parsed and re-encoded.
"""

from typing import Any

from serve_app.wire import sse

Body = dict[str, Any]

# Anthropic's error types by HTTP status, as the spec's ErrorResponse allows them. Its enum has no
# `request_too_large` (the 413 Anthropic's docs name), so a 413 is an invalid request here.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ERROR_TYPES = frozenset(_ERROR_TYPES.values()) | {"api_error"}

# The status behind vLLM's own error type names, for an error event that carries no status.
_VLLM_ERROR_STATUS = {
    "BadRequestError": 400,
    "invalid_request_error": 400,
    "NotFoundError": 404,
    "NotImplementedError": 501,
    "Service Unavailable": 503,
    "ServiceUnavailableError": 503,
    "internal_error": 500,
    "InternalServerError": 500,
}

# Required (and nullable) in the spec, left out by vLLM: present as null.
_MESSAGE_NULLABLE = ("stop_reason", "stop_sequence", "stop_details", "container")
_USAGE_NULLABLE = (
    "cache_creation", "cache_creation_input_tokens", "cache_read_input_tokens", "inference_geo",
    "output_tokens_details", "server_tool_use", "service_tier",
)  # fmt: skip
_DELTA_NULLABLE = ("container", "stop_details", "stop_reason", "stop_sequence")
_DELTA_USAGE_NULLABLE = (
    "cache_creation_input_tokens", "cache_read_input_tokens", "input_tokens", "output_tokens_details",
    "server_tool_use",
)  # fmt: skip
_EXTRAS = ("kv_transfer_params", "ec_transfer_params")

_VLLM_ID_PREFIX = "chatcmpl-"
_ID_PREFIX = "msg_"


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status: any other 4xx is an invalid request, any
    other status an ``api_error``."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(status: int, message: str, request_id: str | None = None) -> Body:
    """An Anthropic error body (also the data of a stream's ``error`` event). The spec requires
    ``request_id``; it is null unless the caller has one."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}, "request_id": request_id}


def error_event(status: int, message: str) -> str:
    """An Anthropic stream's ``error`` event, whoever noticed the failure (replica or router)."""
    return sse.named_event("error", error_body(status, message))


def _setdefault_none(obj: Body, keys: tuple[str, ...]) -> None:
    for key in keys:
        obj.setdefault(key, None)


def _block(block: Any, opening: bool = False) -> None:
    """A content block made schema-exact; ``opening``: as it starts a stream block (empty)."""
    if not isinstance(block, dict):
        return
    kind = block.get("type")
    if kind == "text":
        block.setdefault("citations", None)
    elif kind == "tool_use":
        block.setdefault("caller", {"type": "direct"})
    elif kind == "thinking" and opening:
        block.setdefault("signature", "")


def message(body: Body, request: Body) -> Body:
    """A ``message`` object made schema-exact, in place (and returned). Also the ``message`` of
    a stream's ``message_start``."""
    if isinstance(msg_id := body.get("id"), str) and msg_id.startswith(_VLLM_ID_PREFIX):
        body["id"] = _ID_PREFIX + msg_id[len(_VLLM_ID_PREFIX) :]
    for key in _EXTRAS:
        if key in body and request.get(key) is None:
            del body[key]
    _setdefault_none(body, _MESSAGE_NULLABLE)
    if isinstance(usage := body.get("usage"), dict):
        _setdefault_none(usage, _USAGE_NULLABLE)
    for block in body.get("content") or ():
        _block(block)
    return body


def _vllm_error_status(error: Body) -> int:
    code = error.get("code")
    if isinstance(code, int):
        return code
    return _VLLM_ERROR_STATUS.get(error.get("type"), 500)


# --- stream events: each fix edits the parsed data of one frame -----------------------------


def _message_start(data: Body, request: Body) -> None:
    if isinstance(msg := data.get("message"), dict):
        message(msg, request)


def _content_block_start(data: Body, request: Body) -> None:
    _block(data.get("content_block"), opening=True)


def _message_delta(data: Body, request: Body) -> None:
    if isinstance(delta := data.get("delta"), dict):
        _setdefault_none(delta, _DELTA_NULLABLE)
    if isinstance(usage := data.get("usage"), dict):
        _setdefault_none(usage, _DELTA_USAGE_NULLABLE)


def _error(data: Body, request: Body) -> None:
    error = data.get("error") if isinstance(data.get("error"), dict) else {}
    if error.get("type") not in ERROR_TYPES:
        error["type"] = error_type(_vllm_error_status(error))
    error.pop("code", None)
    error.setdefault("message", "Internal server error")
    data["error"] = error
    data.setdefault("request_id", None)


_STREAM_FIXES = {
    "message_start": _message_start,
    "content_block_start": _content_block_start,
    "message_delta": _message_delta,
    "error": _error,
}
_DELTA_FRAME = "event: content_block_delta\n"


def stream_event(frame: str, request: Body) -> str:
    """One SSE frame of vLLM's Anthropic stream, schema-exact. ``content_block_delta`` (one per
    token), ``content_block_stop``, ``message_stop`` and ``ping`` come back as the same string;
    a frame that does not look like ``event: <name>\\ndata: <json>`` too."""
    if frame.startswith(_DELTA_FRAME):
        return frame
    name = sse.name_of(frame)
    fix = _STREAM_FIXES.get(name)
    if fix is None:
        return frame
    try:
        payload = sse.json_of(frame)
    except ValueError:
        return frame
    if not isinstance(payload, dict):
        return frame
    fix(payload, request)
    return sse.named_event(name, payload)
