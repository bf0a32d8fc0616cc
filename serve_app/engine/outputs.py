"""How each surface's vLLM output becomes an answer, SSE bytes and a trailer in the replica.

``VLLMEngine._run`` does the same thing for every surface — validate with vLLM's request model,
call vLLM's serving object, answer a whole body or a stream of events (``protocol.py``), which
``ModelServer`` puts on the wire — and an *output* supplies what differs:

- ``dump``: vLLM's pydantic result as the JSON body (Responses needs ``by_alias`` for ``schema``,
  Anthropic ``exclude_none``; embeddings come as vLLM's JSON response already);
- ``summarize``: the trailer of a non-stream body (engine timing, usage as prompt/completion
  tokens, finish reasons), popping vLLM's ``metrics`` so the client never sees them;
- ``shape``: the body made schema-exact (``openai_shape``, ``responses_shape``, ``anthropic_shape``);
- ``watcher``: what peels the trailer off a stream on its way out, and turns each vLLM event into
  the bytes the client gets (chat's are SSE strings already; Responses' are pydantic events). A
  Responses or Messages watcher holds the stream's terminal event back (``Trailer.terminal``): the
  router sends it last, with the request's timing inside it (``surfaces/dialects.py``).

vLLM is imported inside the methods only: the router imports nothing from here.
"""

import dataclasses
import json
from typing import Any, NamedTuple

from serve_app.engine import anthropic_shape, openai_shape, responses_shape, trailer
from serve_app.wire.messages import ENGINE_UNAVAILABLE, Answer, Trailer
from serve_app.telemetry.logs import module_logger
from serve_app.wire import sse

logger = module_logger(__name__)

Body = dict[str, Any]


class WholeBody:
    """An output's answer of a whole (non-stream) body: dumped, summarized, shaped."""

    def answer(self, result, body: Body) -> Answer:
        response = self.dump(result)
        summary = self.summarize(response)
        self.shape(response, body)
        return Answer(200, response, summary)


class ChatOutput(WholeBody):
    """Chat and completions: vLLM's SSE strings, with usage (and timing) always asked for."""

    def __init__(self, shape):
        self._shape = shape

    def dump(self, result) -> Body:
        return result.model_dump()

    def summarize(self, response: Body) -> Trailer:
        return trailer.from_response(response)

    def shape(self, response: Body, body: Body) -> None:
        if self._shape is not None:
            self._shape(response, body)

    def watcher(self, body: Body) -> trailer.StreamTrailer:
        return trailer.StreamTrailer(trailer.ask_for_usage(body), token_ids_asked=bool(body.get("return_token_ids")))


CHAT = ChatOutput(openai_shape.chat)
COMPLETIONS = ChatOutput(openai_shape.completion)
TOKENIZATION = ChatOutput(openai_shape.without_nulls)
PLAIN = ChatOutput(None)


class EmbeddingsOutput(WholeBody):
    """``/v1/embeddings``: vLLM's pooling serving object answers a JSON response (never a stream);
    its usage is the input tokens, billed as the prompt. Engine timing is not in the body (vLLM
    has none for pooling): the handler adds it (``pooling_timing``).

    ``encoded``: answer with vLLM's JSON as it is, but for its head and tail (``Answer.encoded``):
    2,048 inputs of 1,024 floats are ~42 MB, which decoding here (0.42 s) and encoding again in
    the router (0.95 s, on the event loop every stream of the router shares) cost a tenant nothing
    past the inputs' price."""

    def __init__(self, encoded: bool = False):
        self.encoded = encoded

    def answer(self, result, body: Body) -> Answer:
        if self.encoded and (answer := encoded_embeddings(bytes(result.body), body.get("model"))) is not None:
            return answer
        return super().answer(result, body)

    def dump(self, result) -> Body:
        return json.loads(result.body)

    def summarize(self, response: Body) -> Trailer:
        usage = response.get("usage") or {}
        return Trailer(usage=token_usage(usage.get("prompt_tokens"), 0))

    def shape(self, response: Body, body: Body) -> None:
        openai_shape.embeddings(response, body)

    def watcher(self, body: Body):
        raise TypeError("embeddings never stream")


EMBEDDINGS = EmbeddingsOutput()
# vLLM's compact embeddings JSON: id, object, created, model, then data, then usage (its
# EmbeddingResponse's field order); the data array passes as it is (its items are index, object
# and embedding, OpenAI's).
_DATA, _USAGE = b'"data":[', b'],"usage":'


def encoded_embeddings(raw: bytes, model: Any) -> Answer | None:
    """OpenAI's embeddings body made of vLLM's ``raw`` JSON without decoding its vectors: its
    ``data`` array, then the request's ``model`` and the usage OpenAI sends (what
    ``openai_shape.embeddings`` makes of the decoded body); None when ``raw`` is not laid out as
    expected (the caller decodes it then)."""
    start, end = raw.find(_DATA), raw.rfind(_USAGE)
    if start < 0 or end < start or not raw.endswith(b"}"):
        return None
    try:
        usage = openai_shape.embeddings_usage(json.loads(raw[end + len(_USAGE):-1]))
    except (ValueError, TypeError, AttributeError):
        return None
    tail_json = json.dumps({"model": model, "usage": usage}, separators=(",", ":")).encode()
    encoded = b"".join((b'{"object":"list","data":', memoryview(raw)[start + len(_DATA) - 1:end + 1], b",",
                        memoryview(tail_json)[1:]))
    return Answer(200, {}, Trailer(usage=token_usage(usage["prompt_tokens"], 0)), encoded=encoded)


def token_usage(prompt: int | None, completion: int | None) -> Body | None:
    """OpenAI's usage object of a prompt and completion count; None when neither is known."""
    if prompt is None and completion is None:
        return None
    prompt, completion = prompt or 0, completion or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def anthropic_prompt_tokens(usage: Body) -> int | None:
    """The whole prompt of an Anthropic usage object: Anthropic (and vLLM's layer for it) leaves
    the tokens read from or written to the prefix cache out of ``input_tokens``; the request
    record and the bill count them."""
    if usage.get("input_tokens") is None:
        return None
    cache = (usage.get("cache_read_input_tokens") or 0) + (usage.get("cache_creation_input_tokens") or 0)
    return usage["input_tokens"] + cache


class ResponsesOutput(WholeBody):
    """OpenAI Responses: vLLM yields event objects, which are shaped and framed here."""

    def dump(self, result) -> Body:
        return result.model_dump(mode="json", by_alias=True)

    def summarize(self, response: Body) -> Trailer:
        usage = response.get("usage") or {}
        return Trailer(
            timing=trailer.engine_timing(response.pop("metrics", None)),
            usage=token_usage(usage.get("input_tokens"), usage.get("output_tokens")),
            finish_reasons=(_responses_finish(response),),
        )

    def shape(self, response: Body, body: Body) -> None:
        responses_shape.response(response, body)

    def watcher(self, body: Body) -> "ResponsesStream":
        return ResponsesStream(self, body)


def _responses_finish(response: Body) -> str:
    """``completed``, or why not (``max_output_tokens``), for the request record."""
    details = response.get("incomplete_details") or {}
    return details.get("reason") or response.get("status") or "unknown"


class ResponsesStream:
    """Frames each event as ``event: <type>``, shaped against ``body`` (the client's, with the id it
    continued from). The terminal event is held back for the trailer: its response is the one the
    router stores (``previous_response_id`` continues from it), and the router sends the event
    last with the timing in its response."""

    TERMINAL = ("response.completed", "response.incomplete", "response.failed")

    def __init__(self, output: ResponsesOutput, body: Body):
        self._output, self._body = output, body
        self.terminal: Body | None = None
        self._summary = Trailer()

    def pass_on(self, event) -> str | None:
        if event.type in responses_shape.DELTA_TYPES:
            return responses_shape.delta_sse(event)
        payload = event.model_dump(mode="json", by_alias=True)
        if payload.get("type") == "response.completed" and isinstance(payload.get("response"), dict):
            # Timing off the response before it is shaped (and before the client could see it).
            self._summary = self._output.summarize(payload["response"])
        payload = responses_shape.stream_event(payload, self._body)
        if payload.get("type") in self.TERMINAL:
            self.terminal = payload
            return None
        return responses_shape.sse(payload)

    def refusal(self, first: Any) -> None:
        """vLLM raises a Responses stream's refusal (``Prefetched.raise_early``); no event says it."""
        return None

    def trailer(self) -> Trailer:
        # One dict for both: the handle pickles it once.
        final = self.terminal.get("response") if self.terminal else None
        return dataclasses.replace(self._summary, response=final, terminal=self.terminal)


class ConvertedMessage(NamedTuple):
    """A non-stream Messages answer: vLLM's converted message, and the engine timing of the chat
    response it was converted from (the converter drops it)."""

    message: Any
    metrics: Body | None


class MessagesOutput(WholeBody):
    """Anthropic Messages: vLLM's converter yields finished SSE strings (``event:`` lines); the
    chat stream under the converter reports its engine timing to the request's watcher."""

    def dump(self, result: ConvertedMessage) -> Body:
        body = result.message.model_dump(exclude_none=True)
        if result.metrics is not None:
            body["metrics"] = result.metrics  # summarize() takes it off before the client sees it
        return body

    def summarize(self, response: Body) -> Trailer:
        usage = response.get("usage") or {}
        return Trailer(
            timing=trailer.engine_timing(response.pop("metrics", None)),
            usage=token_usage(anthropic_prompt_tokens(usage), usage.get("output_tokens")),
            finish_reasons=(response["stop_reason"],) if response.get("stop_reason") else (),
        )

    def shape(self, response: Body, body: Body) -> None:
        anthropic_shape.message(response, body)

    def watcher(self, body: Body) -> "MessagesStream":
        return MessagesStream(body)


_FAILED_MID_STREAM = "the model failed during this stream; retry the request"
_MESSAGE_STOP = "event: message_stop\n"


class MessagesStream:
    """Reads usage and the stop reason off ``message_start``/``message_delta``; engine timing
    comes from the chat stream underneath (``peek_chat_metrics``). ``message_stop`` is held back
    for the trailer: the router sends it last, with the timing in it."""

    def __init__(self, body: Body):
        self._body = body
        self.timing = trailer.engine_timing(None)
        self._prompt: int | None = None
        self._completion: int | None = None
        self._stop: list[str] = []
        self._error: tuple[str, int] | None = None
        # vLLM's own error under the stream (``peek_chat_metrics``): its converter loses the
        # message and sends a pydantic complaint as ``internal_error`` instead.
        # Its status and vLLM's error object.
        self.chat_error: tuple[int, Body] | None = None
        self.terminal: Body | None = None
        # The usage is the answer's once message_delta carried it; before (message_start's, for
        # a stream that broke off) it says nothing of the output, and the replica's count bills it.
        self._final = False

    def pass_on(self, event: str) -> str | None:
        if event.startswith("event: content_block_delta"):
            return event  # per token: untouched, unparsed
        if event.startswith(_MESSAGE_STOP):
            self.terminal = sse.json_of(event)
            return None
        name = sse.name_of(event)
        if name in ("message_start", "message_delta"):
            data = sse.json_of(event)
            usage = (data.get("message") or data).get("usage") or {}
            if (prompt := anthropic_prompt_tokens(usage)) is not None:
                self._prompt = prompt
            self._completion = usage.get("output_tokens", self._completion)
            if stop := (data.get("delta") or {}).get("stop_reason"):
                self._stop = [stop]
            self._final = self._final or name == "message_delta"
        elif name == "error":
            status, error = self.chat_error or (500, {})
            if self.chat_error is not None and status >= 500:
                # As for chat: the trailer says the engine failed, and the router resumes the
                # stream elsewhere or ends it with its own error event (in this dialect).
                self._error = (ENGINE_UNAVAILABLE, None)
                return None
            self._error = ("invalid_request", status)
            message = str(error.get("message") or "invalid request") if status < 500 else _FAILED_MID_STREAM
            return anthropic_shape.error_event(status, message)
        return anthropic_shape.stream_event(event, self._body)

    def refusal(self, first: Any) -> Body | None:
        """vLLM's error object when the stream starts with its refusal of the client's input (the
        chat stream under the converter said it first)."""
        if self.chat_error is None or self.chat_error[0] >= 500:
            return None
        return self.chat_error[1] if isinstance(first, str) and first.startswith("event: error") else None

    def trailer(self) -> Trailer:
        code, status = self._error or (None, None)
        return Trailer(
            timing=self.timing,
            usage=token_usage(self._prompt, self._completion) if self._final else None,
            finish_reasons=tuple(self._stop),
            complete=code != ENGINE_UNAVAILABLE,
            error_code=code,
            error_status=status,
            terminal=self.terminal,
        )


async def peek_chat_metrics(chat_events, into: MessagesStream):
    """vLLM's chat SSE stream under an Anthropic stream, unchanged, with the engine timing of its
    usage chunk (``metrics``) noted on ``into`` on the way: the Anthropic converter drops it."""
    async for event in chat_events:
        if event.startswith(trailer.ERROR_PREFIX):
            status, error = trailer.vllm_stream_error(event)
            # A server fault's text is for our log (Serve stamps the request id), not the client.
            if status >= 500:
                logger.error("vLLM's stream under a Messages stream failed (%s): %s", status, error.get("message"))
            into.chat_error = (status, error)
        elif '"metrics":' in event and '"usage":' in event:
            try:
                into.timing = trailer.engine_timing(sse.json_of(event).get("metrics"))
            except ValueError:
                pass
        yield event
