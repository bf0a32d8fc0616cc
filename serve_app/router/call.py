"""The router's end of one handle call to a model replica (``wire/messages.py`` has its items).

``ReplicaCall`` starts the call, waits for the replica's first item (Serve's queue, then the
replica's head), connects to the byte socket the head names, and reads the call's last item. A
replica that sheds the request, died, or cannot be reached becomes a 503 the pipeline may fail over;
nothing else is decided here.

The call is made outside Serve's request-cancellation scope (``detached``): when the client
leaves, the router hangs up the byte socket instead, the replica stops the engine at once, and
the call still ends with its last item, whose token count bills the request (``hang_up``,
``last``). Every path that gives up on the call before that cancels it itself.
"""

import asyncio
import contextvars
import dataclasses
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from grpc.aio import AioRpcError
from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serve_app.errors import APIError, retry_later
from serve_app.router.lines import LineCall, Lines, LineUnavailable
from serve_app.telemetry.logs import module_logger
from serve_app.wire import handoff
from serve_app.wire import socket as wire_socket
from serve_app.wire.messages import ENGINE_UNAVAILABLE, Accepted, Answer, Call, Head, StreamOpen, Trailer
from serve_app.wire.tls import StreamTLSNotConfigured

logger = module_logger(__name__)

# 503 codes that mean a replica (not the model's load) failed: its engine died, or it vanished.
REPLICA_FAILURES = (ENGINE_UNAVAILABLE, "replica_unavailable")
# A replica gone after its head: its direct line closed (ConnectionError), its actor died, or its
# gRPC server did (handle_transport "grpc": a status Serve does not translate).
REPLICA_GONE = (ConnectionError, RayActorError, AioRpcError)
UNKNOWN_REPLICA = "unknown"  # a replica that died before its trailer could name it
# How long a request whose client left may take to send its last item (the replica stops at once on
# the hang-up; this bounds a replica that cannot). Past it the call is cancelled, billed as counted.
LAST_ITEM_WAIT_S = 10.0
# How often a call still waiting for its head through Serve's handle looks whether its model still
# serves here: Serve's queue holds a call while the model has no running replica (its only one
# died) until a replacement starts, minutes on a GPU; the model's 503 fails it over instead.
SERVING_CHECK_S = 1.0


class ReplicaCall:
    """One call on the model's deployment: ``method`` is its handle's method, ``options(stream=True)``,
    on the region's transport (``Services.method_handle``). With ``lines`` (the region's transport is
    ``direct``, ``router/lines.py``) the call goes on the replica's direct line when the model has
    one running replica (``replicas``) whose line is known, and through ``method`` otherwise or when
    the line does not start it; heads name lines to learn."""

    def __init__(self, method: DeploymentHandle, call: Call, model: str, region: str, *,
                 surface: str = "", lines: Lines | None = None, replicas: int = 0,
                 serving: Callable[[], None] | None = None, on_unreachable: Callable[[], None] | None = None):
        """``serving()`` raises the model's 503 once it no longer serves here; ``on_unreachable()``
        is told when a replica's line could not be reached (the tracker then reads Serve's status
        every second, ``ModelStates.suspect``)."""
        self.model, self.region = model, region
        self._method, self._call, self._lines = method, call, lines
        self._serving, self._on_unreachable = serving, on_unreachable
        self.head: Head | None = None
        self.socket: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.handed = False  # the replica writes the stream to the client's connection itself
        self._ticket: str | None = None  # the ticket still to present on the replica's Unix listener
        self.waited_ms: float | None = None  # call → head: Serve's queue plus the replica's own time
        self._head_at = 0.0  # perf_counter when the head came
        self.ended = False  # the call's last item has been read (or it was given up)
        self._started = time.perf_counter()
        line = lines.call(model, surface, call, replicas=replicas) if lines is not None else None
        self._items: Any = line if line is not None else self._by_handle()
        # The items after the head. On Serve's handle an item is used up once its read began (Ray's
        # generator has handed over the object's ref; gRPC's stream ends with a cancelled read): a
        # client leaving during that read left ``last`` nothing, and the request was billed nothing.
        self._after_head = wire_socket.KeptRead()

    def _by_handle(self) -> Any:
        return detached(lambda: self._method.remote(self._call))

    async def _first_item(self) -> Any:
        if isinstance(self._items, LineCall):
            try:
                return await self._items.__anext__()
            except LineUnavailable as err:  # nothing started: through Serve's handle instead
                logger.info("%s: %s; calling through the handle", self.model, err)
                if err.unreachable and self._on_unreachable is not None:
                    self._on_unreachable()
                self._items = self._by_handle()
        return await self._while_serving(self._items.__anext__())

    async def _while_serving(self, head: Any) -> Any:
        """The handle's first item, unless the model stops serving here while Serve still holds
        the call unassigned: it would wait there until a replica is back. No replica had it;
        ``first``'s caller fails it over. A call a replica took waits for that replica's answer
        (the router's view may lag Serve's: a replacement up a moment ago)."""
        if self._serving is None:
            return await head
        waiting = asyncio.ensure_future(head)
        try:
            while True:
                done, _ = await asyncio.wait((waiting,), timeout=SERVING_CHECK_S)
                if done:
                    return waiting.result()
                if not self._assigned():
                    self._serving()
        except APIError:
            waiting.cancel()  # first: cancelled after the call, Ray's read ends in an error nobody reads
            self.cancel()
            raise
        finally:
            waiting.cancel()  # done already, or given up (the client left: ``first`` cancels the call)

    def _assigned(self) -> bool:
        """Serve's router has handed the call to a replica (Ray 2.60's handle response resolves
        its replica future then: private API, held by ``tests/unit/test_byte_stream.py``)."""
        future = getattr(self._items, "_replica_result_future", None)
        return future is not None and future.done()

    @property
    def by_line(self) -> bool:
        """The call went on a replica's direct line (not Serve's handle)."""
        return isinstance(self._items, LineCall)

    async def first(self) -> Head:
        """The replica's head; a shed or dead replica is a 503 (``overloaded``, ``replica_unavailable``,
        ``engine_unavailable``)."""
        try:
            head = await self._first_item()
        except asyncio.CancelledError:  # the client left before the head: the engine may stop
            self.cancel()
            raise
        except BackPressureError:
            raise retry_later(f"{self.model} is at capacity in region {self.region}", "overloaded") from None
        except (RayActorError, AioRpcError):  # died, or its gRPC server did (handle_transport "grpc")
            logger.exception("model replica for %s died", self.model)
            raise self._vanished() from None
        self._head_at = time.perf_counter()
        self.waited_ms = (self._head_at - self._started) * 1000
        self.head = head
        if self._lines is not None:
            self._learn(head)
        if isinstance(head, Answer):
            self.ended = True
            raise_if_engine_died(head)
        else:
            await self._connect(head)
        return head

    async def _next(self) -> Any:
        return await self._after_head.next(self._items.__anext__)

    async def answer(self) -> Answer:
        """An ``Accepted`` request's answer (the engine's whole body)."""
        try:
            answer = await self._next()
        except REPLICA_GONE:  # its engine request went with it
            logger.exception("model replica for %s vanished", self.model)
            self._end()
            raise self._vanished() from None
        self._end()
        raise_if_engine_died(answer)
        return answer

    async def trailer(self) -> Trailer:
        """A stream's trailer, once the replica has closed the socket: the engine is done. A
        replica that died instead sends none: the stream ended as an engine's death ends one (a
        503 error event that says retry), not resumable (what it generated died with it)."""
        try:
            trailer = await self._next()
        except REPLICA_GONE:
            logger.exception("model replica for %s vanished mid-stream", self.model)
            # Its replica, as far as the head says (its line's id; Serve's handle names none): a
            # stream a peer forwarded here is then recorded here, as one this region served part of.
            line = getattr(self.head, "line", None)
            trailer = Trailer(complete=False, error_code=ENGINE_UNAVAILABLE,
                              replica=line.replica if line is not None else UNKNOWN_REPLICA)
        self._end()
        return trailer

    @property
    def reader(self) -> asyncio.StreamReader:
        """A stream's bytes, from the replica's byte socket."""
        return self.socket[0]

    @property
    def since_head_ms(self) -> float | None:
        """Milliseconds since the replica's head came (None before): a failed engine's time."""
        return None if self.head is None else (time.perf_counter() - self._head_at) * 1000

    @property
    def under_way(self) -> bool:
        """The replica has started on the request and its last item is still to come."""
        return self.head is not None and not self.ended

    def present(self, client: socket.socket | None, *, keep: bool, stall_s: float) -> bool:
        """Start a stream's bytes: over the replica's Unix listener, hand ``client`` (the client's
        connection, its response head written) over to the replica, which writes the stream to it
        (``wire/handoff.py``; ``keep``: and keeps what it wrote, for a resume); True if handed.
        Otherwise (``client`` None, or a replica on another node, whose ticket went at connect)
        the bytes come on the byte socket to relay. OSError: the replica is gone."""
        if self._ticket is None:
            return False
        ticket, self._ticket = self._ticket, None
        mode = "S" if client is None else "K" if keep else "H"
        writer = self.socket[1]
        sock = None if writer.is_closing() else writer.get_extra_info("socket")  # once the call ended: none
        handoff.present(sock.fileno() if sock is not None else -1, ticket, mode, stall_s, client)
        self.handed = client is not None
        return self.handed

    def hang_up(self) -> None:
        """The client left: close the byte socket, the replica's cue to stop the engine now."""
        if self._ticket is not None:  # the replica waits for the ticket first
            try:
                self.present(None, keep=False, stall_s=0)
            except OSError:
                pass
        self._close_socket()

    async def last(self) -> Trailer | None:
        """After ``hang_up``: the trailer the replica still sends (the tokens generated), or None
        when none came in time (the call is cancelled then)."""
        try:
            item = await asyncio.wait_for(self._next(), LAST_ITEM_WAIT_S)
        except Exception as err:  # no trailer in time, or the replica died: bill what is known
            logger.warning("no last item from %s after its client left (%r)", self.model, err)
            self.cancel()
            return None
        finally:
            self._end()
        return item.trailer if isinstance(item, Answer) else item

    def cancel(self) -> None:
        self._end()
        self._after_head.cancel()
        self._items.cancel()

    def _end(self) -> None:
        """The call's last item is read, or the call given up: its byte socket closes now, not when
        the call is collected (a resumed stream's earlier calls, a non-stream request's hang-up line)."""
        self.ended = True
        self._close_socket()

    def _close_socket(self) -> None:
        if self.socket is not None:
            self.socket[1].close()

    async def _connect(self, head: StreamOpen | Accepted) -> None:
        """Connect to the listener the head names before any byte goes to the client, so a replica
        that cannot be reached is still a clean 503 (which may fail over), not a broken 200."""
        try:
            if head.local is not None and head.node == handoff.this_node():  # the replica's node
                local = await asyncio.wait_for(handoff.connect(head.local), wire_socket.CONNECT_TIMEOUT_S)
                self.socket = await handoff.open_streams(local)
                self._ticket = head.ticket  # presented with the stream's start (``present``)
                if isinstance(head, Accepted):  # no bytes will come: the socket is the hang-up line
                    self.present(None, keep=False, stall_s=0)
            else:
                self.socket = await wire_socket.connect(head.address, head.ticket, tls=head.tls)
        except (OSError, asyncio.TimeoutError, StreamTLSNotConfigured):
            self.cancel()
            logger.exception("cannot reach the byte socket of %s at %s:%s", self.model, *head.address)
            raise self._vanished() from None
        except asyncio.CancelledError:  # the client left while connecting: the engine may stop
            self.cancel()
            raise

    def _learn(self, head: Head) -> None:
        """A head names its replica's line (learnt, or seen again: it stays in use); one whose
        engine died, its line is forgotten (Serve stops routing to it once its health check fails;
        the line, at once)."""
        if isinstance(head, Answer):
            if head.status == 503 and self.by_line:
                self._items.forget_line()
        elif head.line is not None:
            self._lines.learn(self.model, head.line)

    def _vanished(self) -> APIError:
        return retry_later(f"{self.model} replica became unavailable", "replica_unavailable")


def raise_if_engine_died(answer: Answer) -> None:
    """A replica whose engine died answers 503 ``engine_unavailable``: another replica may serve."""
    if answer.status == 503:
        error = answer.body["error"]
        raise retry_later(error["message"].removesuffix("; retry"), error["code"] or "unavailable")


def detached(call: Callable[[], Any]) -> Any:
    """Make a handle call that Serve does not cancel with the request that made it.

    Serve cancels every handle call a request made, queued or running, when that request is
    cancelled — as the router's is when its client disconnects. A generating call must outlive its
    client: the replica stops the engine on the router's hang-up and still ends the call with the
    tokens it generated. So the call is made under a copy of Serve's request context with an
    internal id of its own (Serve files child calls under the parent's internal id), keeping the
    request id its logs and traces use.

    Serve's request context is private API (``ray.serve.context``, Ray 2.60 as pinned);
    ``tests/unit/test_byte_stream.py`` holds it to what this relies on.
    """
    current = serve_context._get_serve_request_context()
    own = dataclasses.replace(
        current, _internal_request_id=str(uuid.uuid4()), cancel_on_parent_request_cancel=False
    )
    context = contextvars.copy_context()
    context.run(serve_context._serve_request_context.set, own)
    return context.run(call)
