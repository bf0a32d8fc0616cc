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

from serve_app.config import TINY_MODEL_SOURCE, ModelDeploymentArgs
from serve_app.engine import context_cap, openai_shape, tokenization, trailer
from serve_app.engine.stream_server import Prefetched, StreamServer
from serve_app.errors import error_body

logger = logging.getLogger("ray.serve")

Head = dict[str, Any]


def resolve_model_path(args: ModelDeploymentArgs, hf_repo: str) -> str:
    source = args.engine.source or hf_repo
    if source == TINY_MODEL_SOURCE:
        from serve_app.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    return source


@serve.deployment
class ModelServer:
    async def __init__(self, args: ModelDeploymentArgs):
        from serve_app.preflight import check_engine_environment

        check_engine_environment()

        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        from serve_app import catalog

        self.model_id = args.id
        self.replica = serve.get_replica_context().replica_id.unique_id
        model_path = resolve_model_path(args, catalog.get(args.id).hf_repo)
        cli_args = args.engine_cli_args(model_path)
        logger.info("starting vLLM for %s: %s", args.id, " ".join(cli_args))
        vllm_args = make_arg_parser(FlexibleArgumentParser()).parse_args(cli_args)
        validate_parsed_serve_args(vllm_args)

        # The same construction as vLLM's own API server (entry.build_and_serve).
        self._engine_context = build_async_engine_client(vllm_args)
        self.engine = await self._engine_context.__aenter__()
        state = State()
        await init_app_state(self.engine, state, vllm_args, await self.engine.get_supported_tasks())
        self._chat = state.openai_serving_chat
        self._completion = state.openai_serving_completion
        # /tokenize and /detokenize: vLLM's own serving object, with the chat path's renderer
        # and default template kwargs, so a count here is the count chat will see.
        self._tokenization = state.serving_tokenization
        self._vocab_size = self._tokenization.renderer.get_tokenizer().max_token_id + 1
        context_cap.install(self._chat, "render_chat_request", prompt_param="messages")
        context_cap.install(self._completion, "render_completion_request", prompt_param="prompt")
        self._streams = StreamServer(stream_host())

    async def chat(self, body: dict[str, Any]) -> AsyncIterator[Head | str]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        _apply_enable_thinking(body)
        create = self._chat.create_chat_completion
        async for item in self._plain_errors(self._serve(ChatCompletionRequest, create, body, openai_shape.chat)):
            yield item

    async def completions(self, body: dict[str, Any]) -> AsyncIterator[Head | str]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        create = self._completion.create_completion
        async for item in self._plain_errors(self._serve(CompletionRequest, create, body, openai_shape.completion)):
            yield item

    async def tokenize(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        """``POST /tokenize``: one non-stream head with vLLM's ``TokenizeResponse``."""
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

        _apply_enable_thinking(body)
        tokenization.never_stream(body)
        request_type = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        create = self._tokenization.create_tokenize
        async for item in self._plain_errors(self._serve(request_type, create, body, openai_shape.without_nulls)):
            yield item

    async def detokenize(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        """``POST /detokenize``: one non-stream head with vLLM's ``DetokenizeResponse``."""
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        tokenization.never_stream(body)
        async for item in self._plain_errors(self._serve(DetokenizeRequest, self._detokenize, body)):
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
        try:
            async for item in items:
                head_sent = head_sent or "status" in item
                yield item
        except Exception:
            dead = self.engine.errored
            logger.exception("%s request failed in the replica%s", self.model_id, " (engine dead)" if dead else "")
            code = trailer.ENGINE_UNAVAILABLE if dead else "internal"
            if not head_sent:
                yield _ENGINE_UNAVAILABLE if dead else _INTERNAL_ERROR
            else:
                yield {"trailer": {"replica": self.replica, "complete": False, "error_code": code}}

    async def _serve(self, request_type, create, body: dict[str, Any], shape=None) -> AsyncIterator[Head | str]:
        """``shape(response, body)`` makes a non-stream body schema-exact (``openai_shape``)."""
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        started = time.perf_counter()
        client_wants_usage = trailer.ask_for_usage(body) if body.get("stream") else False
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
            response = result.model_dump()
            summary = trailer.from_response(response)
            if shape is not None:
                shape(response, body)
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
        watcher = trailer.StreamTrailer(client_wants_usage)
        complete = False
        connection = None
        try:
            connection = await self._streams.accept(ticket, connected)
            # Cancellation from the router (client gone) raises CancelledError in here; closing
            # vLLM's generator (finally) then aborts the engine request, freeing its KV cache.
            async for event in events:
                if (event := watcher.pass_on(event)) is None:
                    continue
                if not connection.write(event.encode()):
                    break  # the router closed the socket: its client left
                if connection.must_drain():
                    await connection.drain()
            else:
                complete = True
        except (TimeoutError, ConnectionError) as err:
            logger.warning("%s stream to the router broke off: %r", self.model_id, err)
        finally:
            await events.aclose()
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
