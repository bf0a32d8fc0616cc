"""The model deployment: one vLLM ``AsyncLLM`` in-process, fronted by vLLM's own OpenAI serving layer.

vLLM already does prompt rendering, tool parsing, guided decoding, reasoning parsing, sampling and
SSE framing; this class only adapts it to a Serve streaming handle. Each call yields a *head*
first (``{"status", "body", "stream"}``) so the router can answer errors with their real status
before any byte of a stream is sent. A stream's events do not follow over the handle: the head
names this replica's stream listener and a ticket, and vLLM's SSE events go to the router's
connection as bytes, as they are produced (``stream_server.py``). The handle call stays open
until the stream ends and yields the *trailer* last, so Serve counts the request as ongoing for
its whole life (admission, autoscaling, drain) and cancelling it aborts the engine request.

vLLM is imported inside the replica only: the router and the unit tests never load torch.
"""

import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from serve_app.config import ModelDeploymentArgs
from serve_app.engine import context_cap, stream_server, surfaces, token_count, tokenization, trailer
from serve_app.engine.stream_server import Prefetched, StreamServer
from serve_app.errors import error_body

logger = logging.getLogger("ray.serve")

Head = dict[str, Any]


@serve.deployment
class ModelServer:
    async def __init__(self, args: ModelDeploymentArgs, model_path: str):
        """``model_path``: the weights, resolved when the app is built (``app.resolve_model_path``)."""
        from serve_app.engine.preflight import check_engine_environment

        check_engine_environment()

        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.model_id = args.id
        self.replica = serve.get_replica_context().replica_id.unique_id
        cli_args = args.engine_cli_args(model_path)
        logger.info("starting vLLM for %s: %s", args.id, " ".join(cli_args))
        vllm_args = make_arg_parser(FlexibleArgumentParser()).parse_args(cli_args)
        validate_parsed_serve_args(vllm_args)

        # The same construction as vLLM's own API server (entry.build_and_serve).
        self._engine_context = build_async_engine_client(vllm_args)
        self.engine = await self._engine_context.__aenter__()
        token_count.install(self.engine)  # billing counts what the engine generates (token_count.py)
        state = State()
        await init_app_state(self.engine, state, vllm_args, await self.engine.get_supported_tasks())
        self._chat = state.openai_serving_chat
        self._completion = state.openai_serving_completion
        # /tokenize and /detokenize: vLLM's own serving object, with the chat path's renderer
        # and default template kwargs, so a count here is the count chat will see.
        self._tokenization = state.serving_tokenization
        self._vocab_size = self._tokenization.renderer.get_tokenizer().max_token_id + 1
        # Responses and Anthropic Messages: vLLM's serving objects for them, with its in-memory
        # response store off (VLLM_ENABLE_RESPONSES_API_STORE unset): stored responses live in
        # the router's region-wide store, which every router and model replica can reach.
        self._responses = state.openai_serving_responses
        self._messages = state.anthropic_serving_messages
        # vLLM builds its Anthropic object without the per-request metrics the chat object has
        # (--enable-per-request-metrics); the trailer's engine timing needs them.
        self._messages.enable_per_request_metrics = self._chat.enable_per_request_metrics
        context_cap.install(self._chat, "render_chat_request", prompt_param="messages")
        context_cap.install(self._messages, "render_chat_request", prompt_param="messages")
        context_cap.install(self._completion, "render_completion_request", prompt_param="prompt")
        self._streams = StreamServer(stream_host())

    async def chat(self, body: dict[str, Any]) -> AsyncIterator[Head | str]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        _apply_enable_thinking(body)
        create = self._chat.create_chat_completion
        async for item in self._plain_errors(self._serve(ChatCompletionRequest, create, body, surfaces.CHAT)):
            yield item

    async def completions(self, body: dict[str, Any]) -> AsyncIterator[Head | str]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        create = self._completion.create_completion
        async for item in self._plain_errors(self._serve(CompletionRequest, create, body, surfaces.COMPLETIONS)):
            yield item

    async def responses(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        """``POST /v1/responses``, stateless here: the router has already replaced a
        ``previous_response_id`` by the conversation it continues, and stores the result."""
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        echo = {"previous_response_id": body.pop(surfaces.ECHO_PREVIOUS_RESPONSE_ID, None)}
        body.pop("previous_response_id", None)  # continued by the router already
        engine_body = {**body, "store": False}  # the router stores; the client's `store` is echoed
        _reasoning_opt_in(engine_body, asked=(body.get("reasoning") or {}).get("effort") not in (None, "none"))
        create = self._responses.create_responses
        surface = surfaces.ResponsesSurface()
        serve = self._serve(ResponsesRequest, create, engine_body, surface, shape_body={**body, **echo})
        async for item in self._plain_errors(serve):
            yield item

    async def messages(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        """``POST /v1/messages`` through vLLM's Anthropic layer, with the tier's priority (its
        request model has no such field) and the engine timing the converter would drop."""
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        priority = body.pop("priority", 0)
        surface = surfaces.MessagesSurface()

        async def create(request, raw_request):
            return await self._create_messages(request, priority, surface.stream)

        async for item in self._plain_errors(self._serve(AnthropicMessagesRequest, create, body, surface)):
            yield item

    async def count_tokens(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        """``POST /v1/messages/count_tokens``: the prompt as the Messages route would render it."""
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        create = self._messages.count_tokens
        async for item in self._plain_errors(self._serve(AnthropicCountTokensRequest, create, body, surfaces.PLAIN)):
            yield item

    async def _create_messages(self, request, priority: int, watcher):
        """vLLM's ``create_messages``, with ``priority`` set on the chat request it converts to."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        anthropic = self._messages
        effort = "none"
        if request.thinking is not None and request.thinking.type == "disabled":
            effort = await anthropic._get_disabled_thinking_effort()
        chat_request = anthropic.to_chat_completion_request(
            request, merge_inline_system=anthropic._merge_inline_system, disabled_thinking_effort=effort
        )
        chat_request.priority = priority
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
            return surfaces.ConvertedMessage(anthropic.messages_full_converter(result), metrics)
        return anthropic.message_stream_converter(surfaces.peek_chat_metrics(result, watcher))

    async def tokenize(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        """``POST /tokenize``: one non-stream head with vLLM's ``TokenizeResponse``."""
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

        _apply_enable_thinking(body)
        tokenization.never_stream(body)
        request_type = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        create = self._tokenization.create_tokenize
        async for item in self._plain_errors(self._serve(request_type, create, body, surfaces.TOKENIZATION)):
            yield item

    async def detokenize(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        """``POST /detokenize``: one non-stream head with vLLM's ``DetokenizeResponse``."""
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        tokenization.never_stream(body)
        async for item in self._plain_errors(self._serve(DetokenizeRequest, self._detokenize, body, surfaces.PLAIN)):
            yield item

    async def _detokenize(self, request, raw_request):
        """vLLM's detokenize, after refusing ids the tokenizer does not have: a client's mistake
        is a 400 naming the id, not whatever the tokenizer does with it (skip it, or fail)."""
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

        if (index := tokenization.first_unknown_token(request.tokens, self._vocab_size)) is not None:
            message = tokenization.unknown_token_message(request.tokens[index], self._vocab_size)
            error = ErrorInfo(message=message, type="BadRequestError", param=f"tokens[{index}]", code=400)
            return ErrorResponse(error=error)
        return await self._tokenization.create_detokenize(request, raw_request)

    async def _plain_errors(self, items: AsyncIterator[Head]) -> AsyncIterator[Head]:
        """No exception leaves the replica. One would cross the handle pickled, and unpickling
        vLLM's exception classes (EngineDeadError, …) imports vLLM and torch into the router:
        +460 MiB per router replica, kept. It becomes an error head, or, once a stream's head is
        out, an incomplete trailer that names the failure; the traceback stays in this log."""
        head_sent = False
        count = token_count.start()  # what the engine handles for this request, however it ends
        try:
            async for item in items:
                head_sent = head_sent or "status" in item
                if (summary := item.get("trailer")) is not None:  # a stream's last item, or a JSON head's
                    summary["generated"] = count.as_dict()
                yield item
        except Exception:
            dead = self.engine.errored
            logger.exception("%s request failed in the replica%s", self.model_id, " (engine dead)" if dead else "")
            code = trailer.ENGINE_UNAVAILABLE if dead else "internal"
            if not head_sent:
                yield _ENGINE_UNAVAILABLE if dead else _INTERNAL_ERROR
            else:
                cut = {"replica": self.replica, "complete": False, "error_code": code, "generated": count.as_dict()}
                yield {"trailer": cut}

    async def _serve(
        self, request_type, create, body: dict[str, Any], surface, shape_body: dict[str, Any] | None = None
    ) -> AsyncIterator[Head | str]:
        """Validate ``body`` with vLLM's ``request_type``, run ``create`` and answer it; the
        ``surface`` (``surfaces.py``) dumps, shapes and watches what vLLM returns. ``shape_body``:
        the request as the client sent it, when ``body`` is the engine's variant of it."""
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        started = time.perf_counter()
        shape_body = body if shape_body is None else shape_body
        watcher = surface.watcher(body) if body.get("stream") else None  # may add stream_options
        try:
            request = request_type.model_validate(body)
        except ValidationError as err:
            yield _validation_error_head(err)
            return
        except Exception as exc:  # vLLM's validators raise VLLMValidationError directly
            yield _error_head(create_error_response(exc))
            return
        try:
            result = await create(request, None)
        except Exception as exc:  # vLLM raises for bad input too; it maps them itself
            if self.engine.errored:
                # The engine core died; Serve's health check replaces this replica. 503 tells
                # clients (the openai SDK retries it by default) to come back, not that it's a bug.
                logger.exception("%s engine is dead", self.model_id)
                yield _ENGINE_UNAVAILABLE
                return
            result = create_error_response(exc)
            if result.error.code >= 500:
                logger.exception("%s request failed", self.model_id)
        if isinstance(result, ErrorResponse):
            yield _error_head(result)
            return
        if not getattr(request, "stream", False):  # tokenize requests have no `stream` at all
            response = surface.dump(result)
            summary = surface.summarize(response)
            surface.shape(response, shape_body)
            summary["replica_ms"] = _ms_since(started)
            yield {"status": 200, "body": response, "stream": False, "trailer": {**summary, "replica": self.replica}}
            return
        await self._streams.start()
        ticket, connected = self._streams.expect()
        events = Prefetched(result)  # the engine starts on it while the head travels
        yield {
            "status": 200, "body": None, "stream": True,
            "socket": self._streams.address, "ticket": ticket, "replica_ms": _ms_since(started),
        }
        complete = False
        connection = None
        try:
            connection = await self._streams.accept(ticket, connected)
            complete = await stream_server.pump(events, watcher.pass_on, connection)
        except (TimeoutError, ConnectionError) as err:
            logger.warning("%s stream to the router broke off: %r", self.model_id, err)
        finally:
            await events.aclose()  # vLLM aborts an unfinished engine request, freeing its KV cache
            if connection is not None:
                connection.close()
        yield {"trailer": {**watcher.trailer(), "replica": self.replica, "complete": complete}}

    async def check_health(self) -> None:
        """Serve calls this periodically; a dead engine core fails the replica so Serve replaces it."""
        await self.engine.check_health()

    def engine_stats(self) -> dict[str, int]:
        return {"unfinished_requests": self.engine.get_num_unfinished_requests()}

    def __del__(self) -> None:
        if getattr(self, "_streams", None) is not None:
            self._streams.close()
        context = getattr(self, "_engine_context", None)
        if context is not None:
            self.engine.shutdown()


def stream_host() -> str:
    """The address the stream listener binds and routers connect to: this node's IP (routers on
    other nodes must reach it), or ``SERVE_APP_STREAM_HOST`` (the local config: 127.0.0.1)."""
    if host := os.environ.get("SERVE_APP_STREAM_HOST"):
        return host
    import ray

    return ray.util.get_node_ip_address()


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


_ENGINE_UNAVAILABLE: Head = {
    "status": 503,
    "body": error_body(
        503, "the model engine on this replica failed and is being replaced; retry", code="engine_unavailable"
    ),
    "stream": False,
}


_INTERNAL_ERROR: Head = {
    "status": 500,
    "body": error_body(500, "the model replica failed to serve this request; it has been logged", code="internal"),
    "stream": False,
}


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


def _error_head(response) -> Head:
    error = response.error
    code = context_cap.CONTEXT_LENGTH_EXCEEDED if context_cap.is_context_overflow(error) else None
    return {
        "status": error.code,
        "body": error_body(error.code, error.message, param=error.param, code=code),
        "stream": False,
    }


def _validation_error_head(err) -> Head:
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param

    errors = err.errors()
    first = errors[0]
    param = clean_loc_for_param(tuple(first["loc"])) if first.get("loc") else None
    details = "; ".join(
        f"{clean_loc_for_param(tuple(e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5]
    )
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return {"status": 400, "body": error_body(400, f"invalid request: {details}{more}", param=param), "stream": False}
