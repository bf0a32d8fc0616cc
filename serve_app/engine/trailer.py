"""What the replica tells the router about a finished request (its ``wire.Trailer``), peeled off
vLLM's own output.

vLLM (``--enable-per-request-metrics``) attaches per-request engine timing as ``metrics`` to a
response or, for a stream, to the final usage chunk, which it only emits when usage is requested.
The replica always asks for usage, hands the numbers to the router in the trailer, and shows the client only what the client asked for: the usage chunk only
if requested, never the ``metrics`` field. The router ends every stream itself (timing event, then
``[DONE]``), so vLLM's ``[DONE]`` is dropped here.

vLLM's durations are differences of engine-core monotonic timestamps: queue = scheduled − queued,
prefill = first token − scheduled (vLLM calls it ``time_to_first_token_ms``), decode = last token
− first token. No clock is mixed with another.
"""

from typing import Any

from serve_app.errors import error_body
from serve_app.telemetry.logs import module_logger
from serve_app.wire import sse
from serve_app.wire.messages import ENGINE_UNAVAILABLE, EngineTiming, Trailer

logger = module_logger(__name__)

VLLM_DONE = sse.DONE.rstrip()  # vLLM's end of a stream: dropped here, the router ends it (surfaces/dialects.py)
ERROR_PREFIX = 'data: {"error"'
# vLLM-only chunk fields it writes as null when nobody asked for them (`token_ids` on every chat
# chunk, `stop_reason`, `prompt_token_ids`, `prompt_text`): not in the OpenAI schema, and a null
# says nothing, so they are cut out as text — no JSON parse, ~0.3 µs a chunk. When asked for
# (`return_token_ids`, a matched `stop`), they are not null and pass untouched.
_VLLM_NULLS = (',"token_ids":null', ',"stop_reason":null', ',"prompt_token_ids":null', ',"prompt_text":null')
# A chat chunk's logprobs object needs `refusal` beside `content` (as in openai_shape.chat).
_CHAT_LOGPROBS = '"logprobs":{"content":'
_CHAT_LOGPROBS_EXACT = '"logprobs":{"refusal":null,"content":'


def engine_timing(metrics: dict[str, Any] | None) -> EngineTiming:
    metrics = metrics or {}
    return EngineTiming(
        queue_ms=metrics.get("queue_time_ms"),
        prefill_ms=metrics.get("time_to_first_token_ms"),
        decode_ms=metrics.get("generation_time_ms"),
    )


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make a stream request carry usage (and so timing); returns whether the client asked."""
    options = dict(body.get("stream_options") or {})
    wanted = bool(options.get("include_usage"))
    options["include_usage"] = True
    body["stream_options"] = options
    return wanted


def vllm_stream_error(event: str) -> tuple[int, dict[str, Any]]:
    """The HTTP status and error object of vLLM's mid-stream error event (``data: {"error": …}``,
    ``code`` being the status); 500 and no detail when it cannot be read."""
    try:
        error = sse.json_of(event)["error"]
        return int(error.get("code") or 500), error
    except (ValueError, KeyError, TypeError):
        return 500, {}


def _finish_reasons(choices: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for c in choices if c.get("finish_reason")]


def from_response(body: dict[str, Any]) -> Trailer:
    """The trailer of a non-stream response; removes ``metrics`` from ``body``."""
    return Trailer(
        timing=engine_timing(body.pop("metrics", None)),
        usage=body.get("usage"),
        finish_reasons=tuple(_finish_reasons(body.get("choices") or [])),
    )


_PROMPT_TOKEN_IDS = '"prompt_token_ids":['


def _without_prompt_token_ids(event: str) -> str:
    payload = sse.json_of(event)
    payload.pop("prompt_token_ids", None)
    for choice in payload.get("choices") or ():
        choice.pop("prompt_token_ids", None)
    return sse.data_event(payload)


def _without_vllm_nulls(event: str) -> str:
    for null in _VLLM_NULLS:
        if null in event:
            event = event.replace(null, "")
    if _CHAT_LOGPROBS in event:
        event = event.replace(_CHAT_LOGPROBS, _CHAT_LOGPROBS_EXACT)
    return event


class StreamTrailer:
    """Watches a vLLM SSE stream on its way out and collects the trailer."""

    def __init__(self, client_wants_usage: bool, *, token_ids_asked: bool = False):
        self.client_wants_usage = client_wants_usage
        self.token_ids_asked = token_ids_asked
        self.usage: dict[str, Any] | None = None
        self.timing = engine_timing(None)
        self.finish_reasons: list[str] = []
        self.error_code: str | None = None  # the stream broke off with an error event...
        self.error_status: int | None = None  # ...whose status the router records
        self.engine_failed = False  # vLLM's own 5xx error event: the router ends (or resumes) it

    def pass_on(self, event: str) -> str | None:
        """The event to forward to the client, or None to drop it."""
        if event.startswith(VLLM_DONE):
            return None
        if event.startswith(ERROR_PREFIX):
            return self._our_error(event)
        # Cheap substring tests first: most events are plain token deltas, parsed by nobody.
        if '"finish_reason":"' in event:
            self.finish_reasons += _finish_reasons(sse.json_of(event).get("choices") or [])
        if '"choices":[]' in event and '"usage":' in event:
            payload = sse.json_of(event)
            self.usage = payload.get("usage")
            self.timing = engine_timing(payload.pop("metrics", None))
            return sse.data_event(payload) if self.client_wants_usage else None
        if not self.token_ids_asked and _PROMPT_TOKEN_IDS in event:
            event = _without_prompt_token_ids(event)  # completions' echo: once, on the first chunk
        return _without_vllm_nulls(event)

    def refusal(self, first: Any) -> dict[str, Any] | None:
        """vLLM's error object when ``first``, the stream's first event, refuses the client's input."""
        if not (isinstance(first, str) and first.startswith(ERROR_PREFIX)):
            return None
        status, error = vllm_stream_error(first)
        return error if status < 500 else None

    def _our_error(self, event: str) -> str | None:
        """vLLM's mid-stream error. A server-side failure (vLLM's ``EngineCore encountered an
        issue. See stack trace (above)…``) is not passed on: the trailer says the engine failed,
        and the router either resumes the stream elsewhere or ends it with its own error event.
        A client's mistake keeps vLLM's message and status."""
        status, error = vllm_stream_error(event)
        if status >= 500:
            # vLLM's words go to this replica's log (Serve stamps it with the request id), not the client.
            logger.error("vLLM's stream failed (%s): %s", status, error.get("message"))
            self.error_code, self.engine_failed = ENGINE_UNAVAILABLE, True
            return None
        self.error_code, self.error_status = "invalid_request", status
        body = error_body(status, str(error.get("message") or "invalid request"), param=error.get("param"))
        return sse.data_event(body)

    def trailer(self) -> Trailer:
        return Trailer(
            timing=self.timing,
            usage=self.usage,
            finish_reasons=tuple(self.finish_reasons),
            complete=not self.engine_failed,
            error_code=self.error_code,
            error_status=self.error_status,
        )
