"""The model deployment: one engine per replica (``VLLMEngine``: vLLM's ``AsyncLLM`` and its own
OpenAI, Responses and Anthropic serving layers), adapted to a Serve streaming handle.

One replica method per surface (``serve_app/surfaces``), each taking a ``wire.Call`` and
yielding the call's items (``wire/messages.py``):

- a whole answer: one ``Answer`` — a non-stream surface that is not billed (counting tokens), or any error
  the engine reports before it starts (the router answers it with its real status);
- a stream: ``StreamOpen`` (the engine has started; its SSE bytes go to the router's connection
  on this replica's listener as they are produced, ``wire/socket.py``), then the ``Trailer``;
- a non-stream request that the engine computes and the caller is billed for (generation, or
  embeddings: the surface's ``billed``): ``Accepted`` at once (the same listener: the router's
  hang-up stops the engine), then the ``Answer`` when the engine is done.

The handle call stays open until the request is over, so Serve counts it as ongoing for its whole
life (admission, autoscaling, drain). When the router hangs up (its client left) the engine
request is aborted and the last item still comes, with the tokens generated so far: they are billed.

The same methods also answer calls on the replica's direct line (``wire/line.py``, named in each
head), which no handle counts: the replica holds calls of both kinds to its
``max_ongoing_requests`` (``counted``), reports the line's to the autoscaling policy
(``record_autoscaling_stats``) and waits for them when Serve stops it (``__del__``).

What this class knows is Serve and that wire; what it asks of an engine is ``protocol.Engine`` —
so it is unit-tested on a fake engine, without Ray or vLLM.
"""

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine

from ray import serve

from serve_app.config import ModelDeploymentArgs
from serve_app.engine import replay, token_count
from serve_app.engine.protocol import Engine
from serve_app.engine.slots import Slots
from serve_app.hot_load.autoscaling import LINE_CALLS_METRIC
from serve_app.errors import error_body
from serve_app.runtime import cpus, heap
from serve_app.surfaces import BY_NAME, SURFACES, Surface
from serve_app.telemetry.logs import module_logger
from serve_app.wire import handoff, tls
from serve_app.wire import line as wire_line
from serve_app.wire import socket as wire_socket
from serve_app.wire.messages import (
    ENGINE_UNAVAILABLE, Accepted, Answer, Call, DirectLine, Refused, StreamOpen, Trailer,
)
from serve_app.wire.socket import Listener

logger = module_logger(__name__)

Item = Answer | StreamOpen | Accepted | Trailer


def vllm_engine(args: ModelDeploymentArgs, model_path: str) -> Engine:
    from serve_app.engine.vllm_engine import VLLMEngine

    return VLLMEngine(args, model_path)


class _ModelServer:
    async def __init__(
        self,
        args: ModelDeploymentArgs,
        model_path: str,
        make_engine: Callable[[ModelDeploymentArgs, str], Engine] = vllm_engine,
    ):
        """``model_path``: the weights, resolved when the app is built (``app.resolve_model_path``);
        ``make_engine``: the engine to serve with (a fake one in unit tests)."""
        self.model_id = args.id
        self._args = args
        self.replica = _replica_id()
        self.in_flight = 0  # calls under way, through the handle or a direct line (or waiting: ``counted``)
        self.line_calls = 0  # of which on a direct line: no handle counts them for the autoscaler
        # Serve admits handle calls up to max_ongoing_requests by its own count, which has no line
        # calls in it: these slots hold the replica's calls of both kinds to that number.
        self._slots = Slots(self._capacity)
        self.stopping = False  # Serve is stopping this replica: the direct lines take no new call
        self.engine = make_engine(args, model_path)
        # On a CPU host (SERVE_APP_GATEWAY_CPUS, runtime/cpus.py): the engine's processes are born
        # with the whole host, this one goes back to the gateway's cores once they are.
        with cpus.engine_start("model replica actor"):
            await self.engine.start()
        # Listening from the start: a replica with no free port in its range fails now, not per request.
        listener = self._listener = Listener(stream_host(), tls.server_context(), on_line=self._serve_line)
        await listener.start()  # TLS: a region option
        # Named in every head: a router whose region calls directly learns it there (wire/line.py).
        self.line = DirectLine(self.replica, listener.line_key, listener.address, tls=listener.tls,
                               local=listener.local, node=handoff.this_node(), capacity=self._capacity())
        heap.freeze_startup()  # start-up's objects, out of the collector's reach

    async def _answer(self, surface: Surface, call: Call) -> AsyncIterator[Item]:
        """The call's items for one request of ``surface`` (see the module's docstring).

        No exception leaves the replica. One would cross the handle pickled, and unpickling
        vLLM's exception classes (EngineDeadError, …) imports vLLM and torch into the router:
        +460 MiB per router replica, kept. It becomes an error answer, or, once the first item is
        out, an incomplete trailer that names the failure; the traceback stays in this log.
        """
        count = token_count.start()  # what the engine handles for this request, however it ends
        started = time.perf_counter()
        if surface.billed and not call.stream:  # the engine computes for it: billed if abandoned
            async for item in self._answer_under_way(surface, call, count, started):
                yield item
            return
        try:
            outcome = await self.engine.answer(surface.name, call)
        except Exception:
            outcome = self._failed()[0]
        if isinstance(outcome, Answer):
            yield self._finished(outcome, count, started)
            return
        listener, connection = self._listener, None
        ticket, connected = listener.expect()
        complete, failure = False, None
        try:  # from here on the engine request is under way: every way out closes it
            # Serve may cancel this call at the yield: the finally still runs.
            yield StreamOpen(listener.address, ticket, _ms_since(started), tls=listener.tls, local=listener.local,
                             node=handoff.this_node(), line=self._advertised())
            connection = await listener.accept(ticket, connected)
            complete = await wire_socket.pump(outcome.events, outcome.watcher.pass_on, connection)
        except (TimeoutError, ConnectionError) as err:
            logger.warning("%s stream to the router broke off: %r", self.model_id, err)
        except Exception:
            _, failure = self._failed()
        finally:
            try:
                await outcome.events.aclose()  # the engine aborts an unfinished request, freeing its KV cache
            finally:  # a second cancellation, or vLLM's generator raising on close: still closed
                _close(listener, connection, ticket)
        # What the engine made that nobody read, counted as its generations close (``_counted``).
        await count.settled(token_count.ABORTED_OUTPUT_WAIT_S)
        trailer = Trailer(complete=False, error_code=failure) if failure else outcome.watcher.trailer()
        trailer = dataclasses.replace(trailer, complete=trailer.complete and complete and not failure)
        client = connection.client if connection is not None else None
        if client is not None and not trailer.complete:  # a handed-over stream: what its client has
            written = bytes(client.written) if client.written is not None else None
            trailer = dataclasses.replace(trailer, written=written, client_gone=client.gone)
        resumed = replay.current() if call.resume is not None else None  # the tail this engine went on from
        if not trailer.complete and count.token_ids is not None:  # where another replica may resume it
            before = resumed.tail if resumed is not None else ()
            trailer = dataclasses.replace(trailer, token_ids=(*before, *count.token_ids))
        generated = count.snapshot()
        if resumed is not None and (dropped := len(call.resume.token_ids) - len(resumed.tail)):
            # The tokens of a character cut at the seam, generated again: the first engine's are billed.
            generated = dataclasses.replace(generated, completion_tokens=max(0, generated.completion_tokens - dropped))
        yield dataclasses.replace(trailer, replica=self.replica, generated=generated)

    async def _answer_under_way(self, surface: Surface, call: Call, count, started: float) -> AsyncIterator[Item]:
        """A non-stream request the engine computes (it generates, or embeds): ``Accepted`` first,
        so that the router can hang up while the engine works (its client left), then the answer —
        or, after a hang-up, an incomplete answer with the tokens handled so far."""
        listener, connection = self._listener, None
        ticket, connected = listener.expect()
        work = asyncio.ensure_future(self.engine.answer(surface.name, call))  # shares this count
        try:
            yield Accepted(listener.address, ticket, _ms_since(started), tls=listener.tls, local=listener.local,
                           node=handoff.this_node(), line=self._advertised())
            connection = await listener.accept(ticket, connected)
            finished = await wire_socket.first_of(work, connection)
        except (TimeoutError, ConnectionError) as err:
            logger.warning("%s: the router's connection broke off: %r", self.model_id, err)
            finished = False
        finally:
            try:
                if not work.done():  # Serve cancelled the call, or the router never connected
                    work.cancel()
                    await wire_socket.until_done(work)
            finally:  # cancelled again while it waited: the socket and the ticket still close
                _close(listener, connection, ticket)
        # What each generation had when aborted, counted (vLLM's serving layer may answer its own
        # cancellation with an error before the generations it merged have closed).
        await count.settled(token_count.ABORTED_OUTPUT_WAIT_S)
        if not finished:  # the router hung up: its client left; the engine request was aborted
            trailer = Trailer(complete=False, replica=self.replica, generated=count.snapshot())
            yield Answer(499, error_body(499, "the client closed the request"), trailer)
            return
        try:
            outcome = work.result()
        except Exception:
            outcome = self._failed()[0]
        yield self._finished(outcome, count, started)

    def _finished(self, answer: Answer, count, started: float) -> Answer:
        """``answer`` with what the engine handled for it: a client error found after the engine
        ran (vLLM refusing to shape what the client's schema made it generate) is billed that
        work, as a success is; a fault of ours or the engine's (5xx, which says retry) is not."""
        trailer = answer.trailer
        if trailer is not None:
            trailer = dataclasses.replace(trailer, replica=self.replica, generated=count.snapshot())
        elif answer.status < 500 and (count.prompt_tokens or count.completion_tokens):
            trailer = Trailer(complete=False, replica=self.replica, generated=count.snapshot())
        return dataclasses.replace(answer, trailer=trailer, replica_ms=_ms_since(started))

    def _failed(self) -> tuple[Answer, str]:
        """Log the exception being handled; the answer a request gets for it before its stream,
        and the code its trailer names after."""
        dead = self.engine.dead
        logger.exception("%s request failed in the replica%s", self.model_id, " (engine dead)" if dead else "")
        if dead:  # the engine core died; Serve's health check replaces this replica: retry
            return _ENGINE_UNAVAILABLE, ENGINE_UNAVAILABLE
        return _INTERNAL_ERROR, "internal"

    async def check_health(self) -> None:
        """Serve calls this periodically; a dead engine core fails the replica so Serve replaces it."""
        await self.engine.check_health()

    def engine_stats(self) -> dict[str, int]:
        return {"unfinished_requests": self.engine.unfinished_requests()}

    def _option(self, name: str) -> float:
        """One of this replica's deployment options as Serve holds it now (a deploy that changes
        ``max_ongoing_requests`` or ``graceful_shutdown_timeout_s`` reconfigures the replica in
        place and hands it a new context). The model application's args carry only what the
        engine is built from (``regions/layout.py``: a change there restarts the replicas), so
        theirs are defaults; outside Serve (unit tests) they are the deployment's."""
        try:
            config = serve.get_replica_context()._deployment_config
        except Exception:  # RayServeException: not in a replica
            return getattr(self._args, name)
        return getattr(config, name)

    def _capacity(self) -> int:
        return int(self._option("max_ongoing_requests"))

    def _advertised(self) -> DirectLine | None:
        """The line a head names, with the capacity it has now: none once Serve is stopping this
        replica."""
        if self.stopping:
            return None
        if self.line.capacity != (capacity := self._capacity()):
            self.line = dataclasses.replace(self.line, capacity=capacity)
        return self.line

    async def counted(self, items: AsyncIterator[Item], *, line: bool = False) -> AsyncIterator[Item]:
        """``items``, the call counted in flight while they last (``line``: and as a line call),
        once it holds one of the replica's slots.

        Serve admits a handle call by its own count of them (``max_ongoing_requests``), which the
        direct lines' calls are not in. A handle call that finds every slot taken by calls of both
        kinds waits here, first come first served, still counted as ongoing by Serve — so once a
        replica is full its lines refuse new calls (``_take``: the waiting count too), Serve's
        count climbs to its limit, and Serve queues and sheds as it does without lines. The engine
        never runs more than ``max_ongoing_requests`` calls of this replica's."""
        self.in_flight += 1
        self.line_calls += line
        try:
            async with self._slots, contextlib.aclosing(items):  # closed here, not by a finalizer later
                async for item in items:
                    yield item
        finally:
            self.in_flight -= 1
            self.line_calls -= line

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve samples this for the autoscaling policy: the calls no handle counted."""
        return {LINE_CALLS_METRIC: self.line_calls}

    async def _serve_line(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await wire_line.serve(reader, writer, self._take)

    def _take(self, method: str, call: Call) -> AsyncIterator[Item] | Refused:
        """A call on a direct line: its items, or why this replica does not take it (the router
        then calls through Serve's handle). Full is this replica's calls from every router and the
        handle, running or waiting for a slot, at its ``max_ongoing_requests``; a call that passes
        it in the same loop turn as others waits for a slot (``counted``)."""
        surface = BY_NAME.get(method)
        if surface is None:
            return Refused("unknown method")
        if self.stopping:
            return Refused("stopping")
        if self.in_flight >= self._capacity():
            return Refused("full")
        return self.counted(self._answer(surface, call), line=True)

    def __del__(self) -> Coroutine | None:
        """Serve calls this when it stops the replica, once the handle's calls are drained, and
        awaits what it returns: with calls its direct lines took still under way, a wait for them
        (the lines take nothing new meanwhile), then the close. Not ``async def``: the garbage
        collector also calls it, and would drop the coroutine unawaited."""
        self.stopping = True
        if getattr(self, "in_flight", 0) > 0:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop to wait on (the collector's call)
                pass
            else:
                return self._close_when_done()
        self._close()
        return None

    async def _close_when_done(self) -> None:
        # Serve kills the replica this long after it began stopping it (the handle's calls drained
        # first, then this): the lines' calls run until then at most.
        deadline = time.monotonic() + self._option("graceful_shutdown_timeout_s")
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self._close()

    def _close(self) -> None:
        if getattr(self, "_listener", None) is not None:
            self._listener.close()
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()


def _replica_method(surface: Surface):
    """The replica method the router calls for ``surface``: ``_answer`` for it."""

    async def replica_method(self, call: Call) -> AsyncIterator[Item]:
        async with contextlib.aclosing(self.counted(self._answer(surface, call))) as items:
            async for item in items:
                yield item

    replica_method.__name__ = replica_method.__qualname__ = surface.name
    return replica_method


for _surface in SURFACES:  # one replica method per surface, named as the surface
    setattr(_ModelServer, _surface.name, _replica_method(_surface))

ModelServer = serve.deployment(_ModelServer, name="ModelServer")


def _close(listener: Listener, connection, ticket: str) -> None:
    if connection is not None:
        connection.close()
    else:
        listener.forget(ticket)


def stream_host() -> str:
    """The address the listener binds and routers connect to: this node's IP (routers on other
    nodes must reach it), or ``SERVE_APP_STREAM_HOST`` (the local config: 127.0.0.1)."""
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


_ENGINE_UNAVAILABLE = Answer(
    503,
    error_body(503, "the model engine on this replica failed and is being replaced; retry", code=ENGINE_UNAVAILABLE),
)
_INTERNAL_ERROR = Answer(
    500, error_body(500, "the model replica failed to serve this request; it has been logged", code="internal")
)
