"""The byte path between a model replica and the router, without Ray: the replica's listener and
``pump`` (serve_app/wire/socket.py), the router's call (serve_app/router/call.py) and relay
(serve_app/router/relay.py) over a real loopback socket, with the handle call stood in for by a
small fake that yields the replica's items."""

import asyncio
import contextlib
import functools
import json
import threading
from dataclasses import replace

import pytest
from ray.exceptions import RayActorError

from router_app import bare_context
from serve_app.errors import APIError
from serve_app.router import relay
from serve_app.router.call import ReplicaCall
from serve_app.wire.messages import Accepted, Call, EngineTiming, Generated, StreamOpen, Trailer
from serve_app.wire.socket import Listener, pump

EVENTS = [
    'data: {"id":"chatcmpl-1","created":7,"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
    'data: {"id":"chatcmpl-1","created":7,"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n',
]
TRAILER = Trailer(
    timing=EngineTiming(queue_ms=1.0, prefill_ms=2.0, decode_ms=3.0),
    usage={"prompt_tokens": 4, "completion_tokens": 2},
    finish_reasons=("length",),
    replica="r1",
)


class FakeHandleCall:
    """What ``handle.chat.remote()`` returns: the head, then the trailer once the replica is done."""

    def __init__(self, head, done: asyncio.Event, trailer=TRAILER):
        self.items, self.done, self.trailer, self.cancelled = [head], done, trailer, False

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        await self.done.wait()
        return self.trailer

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self, made):
        self.made = made

    def __getattr__(self, method):
        handle = self

        class Method:
            def remote(self, call):
                return handle.made

        return Method()


async def _replica(server: Listener, ticket, future, events, done: asyncio.Event, hold: asyncio.Event | None = None):
    """The replica's side of one stream, as ``ModelServer`` runs it: wait for the router,
    ``pump`` the events (``hold``: the engine stalls after the first), close the source."""
    connection = await server.accept(ticket, future)
    produced = []

    async def engine():
        for event in events:
            produced.append(event)
            yield event
            if hold is not None:
                await hold.wait()

    source = engine()
    complete = await pump(source, lambda event: event, connection)
    await source.aclose()  # vLLM's generator: closing it aborts the engine request
    connection.close()
    done.set()
    return complete, len(produced)


async def _start(events, *, hold=None, trailer=TRAILER, handle_call_of=FakeHandleCall):
    server = Listener("127.0.0.1")
    await server.start()
    ticket, future = server.expect()
    done = asyncio.Event()
    replica = asyncio.create_task(_replica(server, ticket, future, events, done, hold))
    handle_call = handle_call_of(StreamOpen(server.address, ticket), done, trailer)
    ctx = bare_context()
    ctx.call = ReplicaCall(FakeHandle(handle_call).chat, Call({}, ctx.id), "m", "local")
    await ctx.call.first()
    return server, replica, handle_call, ctx


async def _collect(events, **kwargs):
    server, replica, handle_call, ctx = await _start(events, **kwargs)
    relayed = b"".join([chunk async for chunk in relay.events(ctx)])
    await replica
    server.close()
    return relayed, ctx, handle_call


async def _until_billed(ctx):
    for _ in range(200):
        if ctx.services.meter.records:
            return
        await asyncio.sleep(0.01)


def test_the_replicas_bytes_reach_the_client_unchanged_then_timing_and_done():
    relayed, exchange, stream = asyncio.run(_collect(EVENTS))
    text = relayed.decode()
    assert text.startswith("".join(EVENTS))
    tail = text[len("".join(EVENTS)):]
    metadata_event, done = tail.rstrip("\n").rsplit("\n\n", 1)
    assert done == "data: [DONE]"
    name, data = metadata_event.split("\n", 1)
    assert name == "event: pg_metadata"
    chunk = json.loads(data.removeprefix("data: "))
    assert chunk["id"] == "chatcmpl-1" and chunk["created"] == 7  # the first chunk's, reused
    assert chunk["pg_metadata"]["inference_total_ms"] == 5.0
    assert exchange.record.output_tokens == 2 and exchange.record.model_replica == "r1"
    assert exchange.record.status == 200 and not stream.cancelled


def test_a_stream_the_replica_did_not_finish_ends_with_an_error_event_not_a_hang():
    relayed, exchange, _ = asyncio.run(_collect(EVENTS[:1], trailer=replace(TRAILER, complete=False)))
    text = relayed.decode()
    assert text.startswith(EVENTS[0])
    error = json.loads(text.split("\n\n")[1].removeprefix("data: "))
    assert error["error"]["type"] == "server_error"
    assert error["error"]["message"] == "the model replica failed mid-stream"
    assert text.endswith("data: [DONE]\n\n")
    assert exchange.record.status == 500


def test_a_client_that_leaves_stops_the_replica_at_once_and_its_tokens_are_still_billed():
    generated = Generated(prompt_tokens=4, completion_tokens=1, cached_tokens=0)
    cut = replace(TRAILER, usage=None, complete=False, generated=generated)

    async def scenario():
        hold = asyncio.Event()  # the engine stalls after its first token: no write could fail
        server, replica, stream, exchange = await _start(EVENTS * 50, hold=hold, trailer=cut)
        events = relay.events(exchange)
        first = await events.__anext__()
        assert first.startswith(b"data: ")
        await events.aclose()  # what Starlette does when the client disconnects
        complete, produced = await asyncio.wait_for(replica, 5)  # the hang-up alone stopped it
        await _until_billed(exchange)
        server.close()
        return stream, exchange, complete, produced

    stream, exchange, complete, produced = asyncio.run(scenario())
    assert not complete and produced == 1  # nothing more was generated once the router hung up
    assert not stream.cancelled  # the call ended with its trailer, not a cancel
    ((_, _, record, billed_tokens, _),) = exchange.services.meter.records  # billed once, as counted
    assert billed_tokens == generated and record is exchange.record
    assert exchange.record.status == 499


def test_a_wrong_ticket_gets_nothing_and_the_expected_stream_times_out():
    async def scenario():
        server = Listener("127.0.0.1")
        await server.start()
        ticket, future = server.expect()
        reader, writer = await asyncio.open_connection(*server.address)
        writer.write(b"0" * 32 + b"\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without a byte
        with pytest.raises(TimeoutError):
            await server.accept(ticket, future, timeout_s=0.05)
        server.close()

    asyncio.run(scenario())


def test_an_unreachable_listener_is_a_503_the_router_can_fail_over_on():
    async def scenario():
        server = Listener("127.0.0.1")
        await server.start()
        address = server.address
        server.close()
        await server._server.wait_closed()
        stream = FakeHandleCall(StreamOpen(address, "t" * 32), asyncio.Event())
        call = ReplicaCall(FakeHandle(stream).chat, Call({}, "r"), "m", "local")
        with pytest.raises(APIError) as raised:
            await call.first()
        return stream, raised.value

    stream, error = asyncio.run(scenario())
    assert error.status == 503 and error.code == "replica_unavailable"
    assert stream.cancelled


def test_a_replica_whose_grpc_call_fails_is_a_503_the_router_can_fail_over_on():
    """On the gRPC transport (``router.handle_transport``) a replica process that died mid-call
    ends the call with a gRPC status Serve does not translate (it maps UNAVAILABLE only)."""
    from grpc import StatusCode
    from grpc.aio import AioRpcError, Metadata

    class FailedCall(FakeHandleCall):
        async def __anext__(self):
            raise AioRpcError(StatusCode.INTERNAL, Metadata(), Metadata(), details="Stream removed")

    async def scenario():
        stream = FailedCall(None, asyncio.Event())
        with pytest.raises(APIError) as raised:
            await ReplicaCall(FakeHandle(stream).chat, Call({}, "r"), "m", "local").first()
        return raised.value

    error = asyncio.run(scenario())
    assert error.status == 503 and error.code == "replica_unavailable"



def _grpc_failure():
    from grpc import StatusCode
    from grpc.aio import AioRpcError, Metadata

    return AioRpcError(StatusCode.INTERNAL, Metadata(), Metadata(), details="Stream removed")


class DiesAfterHead(FakeHandleCall):
    """A replica process that dies once its head is out: the handle's next read fails."""

    def __init__(self, head, done: asyncio.Event, failure: Exception):
        super().__init__(head, done)
        self.failure = failure

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        await self.done.wait()
        raise self.failure


@pytest.mark.parametrize("failure", [_grpc_failure(), RayActorError()])
def test_a_replica_dying_during_a_non_stream_answer_is_a_503_the_router_can_fail_over_on(failure):
    """As before its head (``first``): not a 500 with a traceback, no Retry-After, no failover."""
    async def scenario():
        server = Listener("127.0.0.1")
        await server.start()
        ticket, _ = server.expect()
        done = asyncio.Event()
        done.set()
        call = ReplicaCall(FakeHandle(DiesAfterHead(Accepted(server.address, ticket), done, failure)).chat,
                           Call({}, "r"), "m", "local")
        try:
            await call.first()
            with pytest.raises(APIError) as raised:
                await call.answer()
            return raised.value, call
        finally:
            server.close()

    error, call = asyncio.run(scenario())
    assert (error.status, error.code) == (503, "replica_unavailable") and call.ended


@pytest.mark.parametrize("failure", [_grpc_failure(), RayActorError()])
def test_a_stream_whose_replica_dies_ends_with_the_retryable_503_event(failure):
    dies = functools.partial(DiesAfterHead, failure=failure)  # the replica's bytes end, then no trailer
    relayed, ctx, _ = asyncio.run(_collect(EVENTS[:1], handle_call_of=lambda head, done, _: dies(head, done)))
    text = relayed.decode()
    assert text.startswith(EVENTS[0]) and text.endswith("data: [DONE]\n\n")
    error = json.loads(text.split("\n\n")[1].removeprefix("data: "))["error"]
    assert error["code"] == "engine_unavailable" and "retry" in error["message"]
    assert ctx.record.status == 503 and ctx.record.model_replica == "unknown"  # recorded if forwarded here


def test_prefetched_starts_the_source_at_once_and_closes_it_while_pending():
    from serve_app.engine.prefetch import Prefetched

    async def scenario():
        started, closed = asyncio.Event(), []

        async def engine():
            started.set()
            try:
                yield "first"
                await asyncio.sleep(3600)
                yield "never"
            finally:
                closed.append(True)

        events = Prefetched(engine())
        await asyncio.wait_for(started.wait(), 1)  # running before anyone iterated it
        assert await events.__anext__() == "first"
        await events.aclose()
        assert closed == [True]

        async def slow():
            try:
                await asyncio.sleep(3600)
                yield "late"
            finally:
                closed.append("slow")

        pending = Prefetched(slow())
        await asyncio.sleep(0)
        await pending.aclose()  # the first item never came: still stopped cleanly
        assert closed[-1] == "slow"

    asyncio.run(scenario())


def test_a_started_prefetch_has_sent_the_request_before_its_maker_goes_on():
    """vLLM's generator submits the engine request on its first step, before its first wait (for
    the engine's output): ``Prefetched.started`` returns only after that step, so the replica's
    head is written after the submission, not before it."""
    from serve_app.engine.prefetch import Prefetched

    async def scenario():
        log, output = [], asyncio.Event()

        async def engine():
            log.append("submitted")  # add_request: a ZMQ send, no wait
            await output.wait()  # the engine core's first output
            yield "first"

        made = Prefetched(engine())
        log.append("head")  # made alone: the head would go first
        await made.aclose()
        started = await Prefetched.started(engine())
        log.append("head")
        output.set()
        assert await started.__anext__() == "first"
        return log

    assert asyncio.run(scenario()) == ["head", "submitted", "head"]


def test_a_call_cancelled_while_its_prefetch_starts_leaves_no_engine_request_behind():
    """Serve may cancel the call in ``started``'s turn of the loop, before anyone holds the stream
    to close it: ``started`` closes it itself (vLLM aborts the engine request on close)."""
    from serve_app.engine.prefetch import Prefetched

    async def scenario():
        log = []

        async def engine():
            log.append("submitted")
            try:
                await asyncio.sleep(3600)
                yield "first"
            finally:
                log.append("aborted")

        call = asyncio.ensure_future(Prefetched.started(engine()))
        await asyncio.sleep(0)  # the call is in started's sleep(0); the source's first step is queued
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return list(log)  # as the call ends, not as asyncio.run cancels what is left at its close

    assert asyncio.run(scenario()) == ["submitted", "aborted"]


def test_a_merge_of_engine_requests_refused_as_submitted_is_seen_before_the_head():
    """A completions stream of several prompts is vLLM's merge of one engine request each, every
    one submitted in a task of its own: a refusal (an id the tokenizer lacks, a grammar xgrammar
    cannot compile) comes out of the merge turns of the loop later than a single request's.
    ``MERGED_TURNS`` waits for it, so the replica answers the 4xx a non-stream request gets."""
    from vllm.utils.async_utils import merge_async_iterators

    from serve_app.engine.prefetch import AHEAD, MERGED_TURNS, Prefetched

    async def engine_request(refused: bool):
        if refused:
            raise ValueError("Token id 999999 is out of vocabulary")  # add_request, no wait before it
        await asyncio.sleep(3600)  # the engine's first output
        yield "token"

    async def serving_layer(refused: bool):  # as vLLM's completion stream: an error becomes an event
        try:
            async for _, item in merge_async_iterators(engine_request(False), engine_request(refused)):
                yield item
        except ValueError as error:
            yield f"error: {error}"

    async def first_before_head(refused: bool, turns: int):
        started = await Prefetched.started(serving_layer(refused), ahead=AHEAD, turns=turns)
        first = started.made_first
        await started.aclose()
        return first

    async def scenario():
        return [await first_before_head(refused, turns)
                for refused, turns in ((True, MERGED_TURNS), (True, 1), (False, MERGED_TURNS))]

    assert asyncio.run(scenario()) == ["error: Token id 999999 is out of vocabulary", None, None]


class HandleItems:
    """A handle call's items as Ray's ``ActorReplicaResult`` gives them: a read takes the next
    object's ref from the generator at once, then waits for the object — a read cancelled in that
    wait has used the item up (gRPC's stream ends the call instead: the same loss)."""

    def __init__(self, items, transfer_s=0.05):
        self.items, self.transfer_s, self.cancelled = list(items), transfer_s, False

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        await asyncio.sleep(self.transfer_s)
        return item

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("read", ["answer", "trailer"])
@pytest.mark.parametrize("leaves", ["while it is read", "as it arrives"])
def test_a_client_leaving_while_the_last_item_is_read_leaves_it_to_the_bill(read, leaves):
    """The client leaves while the router reads the call's last item (an Accepted request's
    answer, a stream's trailer), or in the turn it arrives: the router's next wait for it
    (``last``, which bills the request) still gets it — before, it got nothing and the request
    was recorded with no tokens."""
    from serve_app.wire.messages import Answer

    trailer = Trailer(complete=True, generated=Generated(5, 1000))
    item = Answer(200, {"usage": {}}, trailer) if read == "answer" else trailer

    class Method:
        def remote(self, call):
            return HandleItems([item])

    async def scenario():
        call = ReplicaCall(Method(), Call({}, "r"), "m", "local")
        call.head = object()  # under way: the replica accepted it
        reading = asyncio.ensure_future(getattr(call, read)())
        await asyncio.sleep(0.01)
        while leaves == "as it arrives" and not (call._after_head._task and call._after_head._task.done()):
            await asyncio.sleep(0)
        reading.cancel()  # the client leaves: Serve cancels the request's task
        with pytest.raises(asyncio.CancelledError):
            await reading
        assert call.under_way
        return await call.last(), call._items.cancelled

    last, cancelled = asyncio.run(scenario())
    assert last == trailer and not cancelled


def test_a_stream_that_ended_with_an_engine_error_is_recorded_as_503_not_200():
    trailer = replace(TRAILER, error_code="engine_unavailable", error_status=503)
    relayed, exchange, _ = asyncio.run(_collect(EVENTS, trailer=trailer))
    assert relayed.decode().endswith("data: [DONE]\n\n")
    assert (exchange.record.status, exchange.record.error_type) == (503, "engine_unavailable")


def test_a_replica_that_never_sends_its_trailer_is_cancelled_and_the_request_still_billed(monkeypatch):
    from serve_app.router import call

    monkeypatch.setattr(call, "LAST_ITEM_WAIT_S", 0.2)

    async def scenario():
        hold = asyncio.Event()
        server, replica, stream, exchange = await _start(EVENTS * 5, hold=hold)
        stream.done = asyncio.Event()  # the handle call never yields its trailer
        events = relay.events(exchange)
        await events.__anext__()
        await events.aclose()
        await _until_billed(exchange)
        await asyncio.wait_for(replica, 5)
        server.close()
        return stream, exchange

    stream, exchange = asyncio.run(scenario())
    assert stream.cancelled and len(exchange.services.meter.records) == 1
    assert exchange.generated is None and exchange.record.status == 499


def test_a_model_call_is_made_outside_the_requests_cancellation_scope():
    """Serve cancels the handle calls a request made when it is cancelled (its client left),
    filed under the request's internal id: the model call gets an id of its own, and keeps the
    request id of logs and traces (Serve's private request context, as pinned)."""
    from dataclasses import replace

    from ray.serve import context as serve_context

    from serve_app.router.call import detached as detached_from_request

    parent = replace(
        serve_context._get_serve_request_context(),
        request_id="req-1", _internal_request_id="parent", cancel_on_parent_request_cancel=True,
    )
    token = serve_context._serve_request_context.set(parent)
    try:
        async def in_a_task():  # Serve's handle assigns the call in a task made at call time
            return serve_context._get_serve_request_context()

        async def scenario():
            return await detached_from_request(lambda: asyncio.ensure_future(in_a_task()))

        seen = asyncio.run(scenario())
        assert seen.request_id == "req-1"
        assert seen._internal_request_id not in ("", "parent") and not seen.cancel_on_parent_request_cancel
        assert serve_context._get_serve_request_context() is parent  # the request's own is untouched
    finally:
        serve_context._serve_request_context.reset(token)


def test_a_client_gone_before_the_relay_started_is_still_hung_up_settled_and_billed():
    """Starlette may cancel the response before its body is first iterated: the relay's own
    finally never runs, so the response's end settles the request (``RelayedStream``'s ``on_end``)."""
    from serve_app.router.context import abandoned

    async def scenario():
        hold = asyncio.Event()
        server, replica, stream, exchange = await _start(EVENTS * 5, hold=hold)
        exchange.settle(abandoned())
        exchange.settle(abandoned())  # the end is reported once; twice does nothing
        complete, produced = await asyncio.wait_for(replica, 5)  # the replica saw the hang-up
        await _until_billed(exchange)
        server.close()
        return exchange, complete

    exchange, complete = asyncio.run(scenario())
    assert not complete and len(exchange.services.meter.records) == 1 and exchange.record.status == 499


def test_a_started_prefetch_runs_the_source_to_its_first_wait_and_keeps_what_it_made():
    """A Responses stream yields ``response.created`` and ``.in_progress`` before it submits the
    request: ``started`` runs it past them (the request is out before the head), keeps them for
    its reader in order, and holds what the source raised as it submitted (a refusal)."""
    from serve_app.engine.prefetch import Prefetched

    async def scenario():
        log, output = [], asyncio.Event()

        async def responses(refused: bool):
            yield "created"
            yield "in_progress"
            log.append("submitted")
            if refused:
                raise ValueError("Grammar error: Invalid type: strin")
            await output.wait()
            yield "delta"

        started = await Prefetched.started(responses(refused=False), ahead=8)
        log.append("head")
        assert started.made_first == "created"
        await started.raise_early()  # nothing raised: nothing to do
        output.set()
        assert [event async for event in started] == ["created", "in_progress", "delta"]

        refused = await Prefetched.started(responses(refused=True), ahead=8)
        with pytest.raises(ValueError, match="strin"):
            await refused.raise_early()
        return log

    assert asyncio.run(scenario()) == ["submitted", "head", "submitted"]


def test_a_started_prefetch_of_a_source_that_never_waits_stops_before_the_head_and_loses_nothing():
    """A source that yields without waiting runs ``ahead`` items before the head, the rest after,
    in order; a resumed stream's replay (``ahead`` 0) runs only to its first item, which the seam
    relies on; a source that just ends is no refusal."""
    from serve_app.engine.prefetch import Prefetched

    async def scenario(ahead: int):
        pulled = []

        async def replay():
            for index in range(40):
                pulled.append(index)
                yield index

        started = await Prefetched.started(replay(), ahead=ahead)
        before_head = len(pulled)
        await started.raise_early()
        return before_head, [item async for item in started]

    assert asyncio.run(scenario(8)) == (9, list(range(40)))  # 8 kept, the 9th being made
    assert asyncio.run(scenario(0)) == (1, list(range(40)))


@pytest.mark.parametrize("leaves", [False, True])
def test_a_client_leaving_while_its_response_is_stored_still_has_the_stored_bytes_on_its_record(leaves):
    """The store's write runs in the database's thread: a client leaving meanwhile does not stop it
    (the response is stored), so the request's record must still say how much is stored."""

    async def scenario():
        server, replica, _, ctx = await _start(EVENTS)
        writing, written = asyncio.Event(), threading.Event()

        async def keep(response):
            writing.set()
            await asyncio.to_thread(written.wait, 5)  # the database's write, in its thread
            return 321

        ctx.keep = keep
        consumer = asyncio.ensure_future(_drain(relay.events(ctx)))
        await writing.wait()
        if leaves:
            consumer.cancel()  # the client leaves: Serve cancels the request's task mid-write
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(consumer, 1)  # it ends at once, the write still under way...
            assert ctx.services.meter.records == []  # ...and the record waits for the write
        written.set()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        await replica
        await _until_billed(ctx)
        server.close()
        return ctx

    ctx = asyncio.run(scenario())
    assert ctx.services.meter.stored_bytes == [321]
    assert ctx.record.status == (499 if leaves else 200)


async def _drain(events):
    return [chunk async for chunk in events]


def test_a_result_that_came_as_its_client_left_is_still_on_the_record():
    """The work finished, and the request's task was cancelled before it resumed: the record
    still takes the result (``Context.settle`` closes through the finished work too)."""
    from serve_app.router.context import abandoned, even_if_left

    async def scenario():
        ctx = bare_context()
        work = asyncio.get_running_loop().create_future()

        async def waiting():
            return await even_if_left(ctx, work, ctx.note_stored, 1.0)

        task = asyncio.ensure_future(waiting())
        await asyncio.sleep(0)  # the request waits for the work
        work.set_result(99)  # the result comes...
        task.cancel()  # ...and the client leaves before the request's task resumes
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.settle(abandoned())
        await _until_billed(ctx)
        return ctx

    ctx = asyncio.run(scenario())
    assert ctx.services.meter.stored_bytes == [99]


def test_a_handle_response_says_when_serve_has_handed_it_to_a_replica():
    """``ReplicaCall._assigned`` reads Ray's private ``_replica_result_future`` (Ray 2.60, as
    pinned): a handle response holds the future its router resolves with the chosen replica."""
    import concurrent.futures

    from ray.serve.handle import DeploymentResponseGenerator

    from serve_app.router.call import ReplicaCall

    future = concurrent.futures.Future()
    response = DeploymentResponseGenerator(future, request_metadata=None)
    call = object.__new__(ReplicaCall)
    call._items = response
    assert not call._assigned()
    future.set_result(object())  # the replica Serve chose
    assert call._assigned()
