"""The model deployment: one engine per replica (``VLLMEngine``: vLLM's ``AsyncLLM`` and its own
OpenAI, Responses and Anthropic serving layers), adapted to a Serve streaming handle.

Each call yields a *head* first (``{"status", "body", "stream"}``) so the router can answer errors
with their real status before any byte of a stream is sent. A JSON answer rides in the head with
its trailer. A stream's events do not follow over the handle: the head names this replica's
stream listener and a ticket, and the engine's SSE events go to the router's connection as bytes,
as they are produced (``stream_server.py``). The handle call stays open until the stream ends and
yields the *trailer* last (``{"trailer": {...}}``: engine timing, usage, finish reasons, the
engine's own token count), so Serve counts the request as ongoing for its whole life (admission,
autoscaling, drain). When the router hangs up (its client left) the engine request is aborted
and the trailer still comes: the tokens generated so far are billed.

What this class knows is Serve and that wire format; what it asks of an engine is
``protocol.Engine`` — so it is unit-tested on a fake engine, without Ray or vLLM.
"""

import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from serve_app.config import ModelDeploymentArgs
from serve_app.engine import stream_server, token_count, trailer
from serve_app.engine.protocol import Answer, Engine
from serve_app.engine.stream_server import StreamServer
from serve_app.errors import error_body
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

Head = dict[str, Any]


def vllm_engine(args: ModelDeploymentArgs, model_path: str) -> Engine:
    from serve_app.engine.vllm_engine import VLLMEngine

    return VLLMEngine(args, model_path)


def _replica_method(method: str):
    """The replica method the router calls by ``method``'s name: ``ModelServer._answer`` for it."""

    async def replica_method(self, body: dict[str, Any]) -> AsyncIterator[Head]:
        async for item in self._answer(method, body):
            yield item

    replica_method.__name__ = replica_method.__qualname__ = method
    return replica_method


@serve.deployment
class ModelServer:
    async def __init__(
        self,
        args: ModelDeploymentArgs,
        model_path: str,
        make_engine: Callable[[ModelDeploymentArgs, str], Engine] = vllm_engine,
    ):
        """``model_path``: the weights, resolved when the app is built (``app.resolve_model_path``);
        ``make_engine``: the engine to serve with (a fake one in unit tests)."""
        self.model_id = args.id
        self.replica = _replica_id()
        self.engine = make_engine(args, model_path)
        await self.engine.start()
        self._streams = StreamServer(stream_host())

    # --- the replica methods the router calls, one per API surface ------------------------------
    chat = _replica_method("chat")
    completions = _replica_method("completions")
    responses = _replica_method("responses")
    messages = _replica_method("messages")
    count_tokens = _replica_method("count_tokens")
    tokenize = _replica_method("tokenize")
    detokenize = _replica_method("detokenize")

    async def _answer(self, method: str, body: dict[str, Any]) -> AsyncIterator[Head]:
        """The head, then for a stream its bytes on the socket and the trailer.

        No exception leaves the replica. One would cross the handle pickled, and unpickling
        vLLM's exception classes (EngineDeadError, …) imports vLLM and torch into the router:
        +460 MiB per router replica, kept. It becomes an error head, or, once a stream's head is
        out, an incomplete trailer that names the failure; the traceback stays in this log.
        """
        count = token_count.start()  # what the engine handles for this request, however it ends
        started = time.perf_counter()
        try:
            outcome = await self.engine.serve(method, body)
        except Exception:
            failed_head, _ = self._failed()
            yield failed_head
            return
        if isinstance(outcome, Answer):
            head = {"status": outcome.status, "body": outcome.body, "stream": False, "replica_ms": _ms_since(started)}
            if outcome.summary is not None:
                head["trailer"] = {**outcome.summary, "replica": self.replica, "generated": count.as_dict()}
            yield head
            return
        connection = ticket = None
        complete, failure, failed_head = False, None, _INTERNAL_ERROR
        head_sent = False
        try:  # from here on the engine request is under way: every way out closes it
            await self._streams.start()
            ticket, connected = self._streams.expect()
            head_sent = True  # Serve may cancel this call at the yield: the finally still runs
            yield {
                "status": 200, "body": None, "stream": True,
                "socket": self._streams.address, "ticket": ticket, "replica_ms": _ms_since(started),
            }
            connection = await self._streams.accept(ticket, connected)
            complete = await stream_server.pump(outcome.events, outcome.watcher.pass_on, connection)
        except (TimeoutError, ConnectionError) as err:
            logger.warning("%s stream to the router broke off: %r", self.model_id, err)
        except Exception:
            failed_head, failure = self._failed()
        finally:
            await outcome.events.aclose()  # the engine aborts an unfinished request, freeing its KV cache
            if connection is not None:
                connection.close()
            elif ticket is not None:
                self._streams.forget(ticket)
        if not head_sent:  # the stream listener could not start: an error head, as before a stream
            yield failed_head
            return
        summary = {"complete": False, "error_code": failure} if failure else {**outcome.watcher.trailer(), "complete": complete}
        yield {"trailer": {**summary, "replica": self.replica, "generated": count.as_dict()}}

    def _failed(self) -> tuple[Head, str]:
        """Log the exception being handled; the head a request gets for it before its stream,
        and the code its trailer names after."""
        dead = self.engine.dead
        logger.exception("%s request failed in the replica%s", self.model_id, " (engine dead)" if dead else "")
        if dead:  # the engine core died; Serve's health check replaces this replica: retry
            return _ENGINE_UNAVAILABLE, trailer.ENGINE_UNAVAILABLE
        return _INTERNAL_ERROR, "internal"

    async def check_health(self) -> None:
        """Serve calls this periodically; a dead engine core fails the replica so Serve replaces it."""
        await self.engine.check_health()

    def engine_stats(self) -> dict[str, int]:
        return {"unfinished_requests": self.engine.unfinished_requests()}

    def __del__(self) -> None:
        """Serve calls this when it stops the replica."""
        if getattr(self, "_streams", None) is not None:
            self._streams.close()
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()


def stream_host() -> str:
    """The address the stream listener binds and routers connect to: this node's IP (routers on
    other nodes must reach it), or ``SERVE_APP_STREAM_HOST`` (the local config: 127.0.0.1)."""
    if host := os.environ.get("SERVE_APP_STREAM_HOST"):
        return host
    import ray

    return ray.util.get_node_ip_address()


def _replica_id() -> str:
    """This Serve replica's tag; outside Serve (unit tests) a placeholder."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # RayServeException: not in a replica
        return "unserved"


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
