"""OpenAI Responses bodies and stream events as the specifications have them, from vLLM's dumps.

Two specifications (tests/data/schemas): OpenAI's and Open Responses. Where they disagree, Open
Responses' stricter rule is the one kept (the fields it requires, ``null`` when unknown, are what
OpenAI's own API sends and its SDK types ``Optional``); data/schemas/README.md lists each case.

vLLM's ``ResponsesResponse`` (``model_dump(mode="json", by_alias=True)``) is not the object OpenAI
sends. It lacks fields the specs require (``error``; ``safety_identifier`` and
``prompt_cache_key``, required by Open Responses) or every client reads (``completed_at``,
``store``), echoes what vLLM did to the request instead of what the client asked for
(``tool_choice`` becomes ``"none"`` without tools, ``service_tier`` stays ``"auto"``), dumps ``null``
for unset objects (``text``, ``reasoning``, ``metadata``, ``top_logprobs``, ``user``), carries fields
of a newer SDK as ``null`` inside items and tools (``phase``, ``namespace``, ``async``, ``caller``,
``defer_loading``…), leaves an ``output_text`` part's ``logprobs`` ``null`` where the spec requires
an array, and adds its own extras (``kv_transfer_params``, ``input_messages``, usage
``*_per_turn``…). Here:

- top level: a ``null`` stays where the specs allow it (OpenAI sends every top-level field, set or
  not; ``usage`` is ``null`` in ``response.created`` and ``.in_progress``, until it is known), the
  missing fields are added with what the request asked for or the spec's default
  (``safety_identifier`` and ``prompt_cache_key`` echo the request's, else ``null``), and a ``null``
  the specs forbid is dropped;
- inside output items, content parts and tools, a ``null`` is dropped unless a spec requires the
  field (a function tool's ``strict``/``parameters``/``description``), as ``openai_shape`` does
  for chat;
- a vLLM extra is kept only when the request asked for it (``kv_transfer_params``,
  ``ec_transfer_params``; ``enable_response_messages`` → ``input_messages``/``output_messages``).
  ``metrics`` is the replica's to pop first (engine timing for the trailer); a leftover is dropped.

Stream events are shaped one at a time on their way out, so the per-token deltas cost a dict
lookup or two; only the few events that carry a response, an item or a part are walked. vLLM ends
every stream with ``response.completed``, whatever the status; OpenAI sends
``response.incomplete``/``response.failed`` then, and so do we. An ``error`` event carries both
specs' shapes: OpenAI's ``code``/``message``/``param`` at the top, Open Responses' ``error``
object. Per-token ``logprobs`` entries are left as vLLM builds them (walking them would cost per
token).
"""

import time
from typing import Any

from serve_app.wire.sse import named_event, named_frame

Body = dict[str, Any]

# Top-level fields the spec lets be null: a null there stays (OpenAI always sends them).
_TOP_NULLABLE = frozenset(
    {
        "error", "completed_at", "incomplete_details", "instructions", "output_text", "conversation",
        "max_output_tokens", "previous_response_id", "reasoning", "background", "max_tool_calls",
        "prompt", "truncation", "metadata", "top_logprobs", "temperature", "top_p", "service_tier",
        "prompt_cache_retention", "usage", "safety_identifier", "prompt_cache_key",
    }
)  # fmt: skip

# Required and nullable inside an item or tool, by its `type`: present as null rather than absent.
_ITEM_REQUIRED_NULLABLE = {
    "code_interpreter_call": frozenset({"code", "outputs"}),  # the Harmony path emits these
    "image_generation_call": frozenset({"result"}),
}
_TOOL_REQUIRED_NULLABLE = {"function": frozenset({"strict", "parameters", "description"})}
_NOTHING: frozenset[str] = frozenset()

# What the usage details hold. vLLM adds tool_output_tokens and per-turn lists (its multi-turn
# tool loop), which no client knows. `cache_write_tokens` is newer than the vendored spec but
# OpenAI's: the openai SDK (3.57) requires it, so it stays.
_USAGE_DETAILS = {
    "input_tokens_details": ("cached_tokens", "cache_write_tokens"),
    "output_tokens_details": ("reasoning_tokens",),
}

# Service tiers a request can name; "auto" (or none) means the tier actually used, ours.
_NAMED_TIERS = frozenset({"default", "flex", "scale", "priority"})


def _asked(request: Body) -> dict[str, bool]:
    """Which vLLM-only response fields this request asked for."""
    messages = bool(request.get("enable_response_messages"))
    return {
        "kv_transfer_params": request.get("kv_transfer_params") is not None,
        "ec_transfer_params": request.get("ec_transfer_params") is not None,
        "input_messages": messages,
        "output_messages": messages,
        "metrics": False,  # the replica's: it pops it before shaping; never the client's
    }


def _drop_nulls(obj: Body, keep: frozenset[str] = _NOTHING) -> None:
    for key in [key for key, value in obj.items() if value is None and key not in keep]:
        del obj[key]


def _part(part: Any) -> None:
    """A content part (of a message, or of a content_part event) made schema-exact."""
    if not isinstance(part, dict):
        return
    if part.get("type") == "output_text":
        # Required arrays; vLLM leaves logprobs null unless they were asked for.
        if part.get("logprobs") is None:
            part["logprobs"] = []
        if part.get("annotations") is None:
            part["annotations"] = []
    _drop_nulls(part)


def _item(item: Any) -> None:
    """An output item (of a response, or of an output_item event) made schema-exact."""
    if not isinstance(item, dict):
        return
    kind = item.get("type")
    if kind == "message":
        for part in item.get("content") or ():
            _part(part)
    elif kind == "reasoning" and item.get("summary") is None:
        item["summary"] = []  # required, even when the model gave no summary
    _drop_nulls(item, _ITEM_REQUIRED_NULLABLE.get(kind, _NOTHING))


def _tool(tool: Any) -> None:
    if isinstance(tool, dict):
        required = _TOOL_REQUIRED_NULLABLE.get(tool.get("type"), _NOTHING)
        for key in required:
            tool.setdefault(key, None)
        _drop_nulls(tool, required)


def _usage(usage: Body) -> None:
    for name, counts in _USAGE_DETAILS.items():
        details = usage.get(name) or {}
        usage[name] = {count: details.get(count) or 0 for count in counts}


def _text(text: Any) -> Body:
    """The ``text`` config: the request's (as vLLM echoes it) without its nulls, else plain text."""
    if not isinstance(text, dict):
        return {"format": {"type": "text"}}
    _drop_nulls(text)
    if isinstance(fmt := text.get("format"), dict):
        _drop_nulls(fmt)
        if fmt.get("type") == "json_schema":
            # Open Responses requires both: `description` nullable, `strict` a boolean (OpenAI's
            # default is false).
            fmt.setdefault("description", None)
            fmt.setdefault("strict", False)
    else:
        text["format"] = {"type": "text"}
    return text


def _reasoning(reasoning: Any) -> Body:
    # Only what the spec knows; vLLM's SDK adds `context`/`mode`, which OpenAI does not send.
    reasoning = reasoning if isinstance(reasoning, dict) else {}
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")}


def _store(request: Body) -> bool:
    store = request.get("store")
    return True if store is None else bool(store)  # the API's default


def _service_tier(request: Body) -> str:
    tier = request.get("service_tier")
    return tier if tier in _NAMED_TIERS else "default"


def response(body: Body, request: Body) -> Body:
    """A ``response`` object made schema-exact, in place (and returned).

    ``request`` is the body the client sent. Applying this twice changes nothing more, so the
    created/in_progress/completed events may share or repeat it.
    """
    asked = _asked(request)
    for key in asked:
        if key in body and not asked[key]:
            del body[key]
    body.setdefault("error", None)
    if body.get("status") == "completed":
        body["completed_at"] = body.get("completed_at") or int(time.time())
    else:
        body["completed_at"] = None
    body["store"] = _store(request)
    # The router continued the conversation and kept the id away from vLLM (router/responses.py).
    body["previous_response_id"] = request.get("previous_response_id")
    # vLLM rewrites tool_choice to "none" when there are no tools; OpenAI echoes the request.
    tool_choice = request.get("tool_choice")
    body["tool_choice"] = "auto" if tool_choice is None else tool_choice
    body["service_tier"] = _service_tier(request)
    # Open Responses requires both, null when not sent. Echoed only: the prefix-cache partition is
    # the owner's (router/isolation.py), never a key a client picks.
    body["safety_identifier"] = request.get("safety_identifier")
    body["prompt_cache_key"] = request.get("prompt_cache_key")
    body.setdefault("usage", None)
    body["text"] = _text(body.get("text"))
    body["reasoning"] = _reasoning(body.get("reasoning"))
    if body.get("metadata") is None:
        body["metadata"] = {}
    if body.get("top_logprobs") is None:
        # vLLM echoes its sampling logprobs, set only with include=[...logprobs]; OpenAI echoes
        # the request parameter.
        top_logprobs = request.get("top_logprobs")
        body["top_logprobs"] = top_logprobs if isinstance(top_logprobs, int) else 0
    if isinstance(usage := body.get("usage"), dict):
        _usage(usage)
    for item in body.get("output") or ():
        _item(item)
    for tool in body.get("tools") or ():
        _tool(tool)
    # Any other null (`user`, …): absent rather than null, which the specs forbid.
    _drop_nulls(body, _TOP_NULLABLE)
    return body


# --- stream events --------------------------------------------------------------------------


def _with_response(event: Body, request: Body) -> None:
    if isinstance(body := event.get("response"), dict):
        response(body, request)
        if event.get("type") == "response.completed":
            # vLLM's terminal event is always "completed"; OpenAI names it by the status.
            status = body.get("status")
            if status == "incomplete":
                event["type"] = "response.incomplete"
            elif status == "failed":
                event["type"] = "response.failed"


def _with_item(event: Body, request: Body) -> None:
    _item(event.get("item"))


def _with_part(event: Body, request: Body) -> None:
    _part(event.get("part"))


def _with_logprobs(event: Body, request: Body) -> None:
    if event.get("logprobs") is None:
        event["logprobs"] = []


def _error(event: Body, request: Body) -> None:
    event.setdefault("code", None)  # required, nullable
    event.setdefault("param", None)
    event.setdefault("error", error_object(event))


def error_object(event: Body, kind: str = "server_error") -> Body:
    """Open Responses' ``error`` object of an error event (OpenAI's fields, and a ``type``)."""
    return {"type": kind, "code": event.get("code"), "message": event.get("message") or "", "param": event.get("param")}


_EVENT_FIXES = {
    "response.created": _with_response,
    "response.in_progress": _with_response,
    "response.queued": _with_response,
    "response.completed": _with_response,
    "response.incomplete": _with_response,
    "response.failed": _with_response,
    "response.output_item.added": _with_item,
    "response.output_item.done": _with_item,
    "response.content_part.added": _with_part,
    "response.content_part.done": _with_part,
    "response.output_text.done": _with_logprobs,
    "error": _error,
}


def stream_event(event: Body, request: Body) -> Body:
    """One stream event, as dumped (``model_dump(mode="json", by_alias=True)``), made
    schema-exact in place (and returned). Per-token deltas cost a lookup or two."""
    kind = event.get("type")
    if kind == "response.output_text.delta":
        # The one delta the spec gives a required field vLLM may leave out (`logprobs`).
        if event.get("logprobs") is None:
            event["logprobs"] = []
        return event
    fix = _EVENT_FIXES.get(kind)  # reasoning_text / function_call_arguments deltas: None
    if fix is not None:
        fix(event, request)
    return event


# The per-token events: framed straight from vLLM's object, as vLLM's own server does (one
# model_dump_json, ~2 µs), instead of dump → shape → encode (~6 µs), since all a delta can need
# is `stream_event`'s one fix, done on the text.
DELTA_TYPES = frozenset(
    {"response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta"}
)


def delta_sse(event: Any) -> str:
    """A delta event object (``type`` in ``DELTA_TYPES``) as its SSE frame, schema-exact."""
    data = event.model_dump_json(by_alias=True)
    if event.type == "response.output_text.delta" and '"logprobs":null' in data:
        data = data.replace('"logprobs":null', '"logprobs":[]', 1)
    return named_frame(event.type, data)


def sse(event: Body) -> str:
    """The event as one SSE frame, named by its type (no ``[DONE]`` follows in this API)."""
    return named_event(event["type"], event)
