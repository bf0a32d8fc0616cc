"""The byte path between a model replica and the router, without Ray: the replica's stream listener
(serve_app/engine/stream_server.py) and the router's relay (serve_app/router/relay.py) over a real
loopback socket, with the handle call stood in for by a small fake that yields the trailer."""

import asyncio
import json

import pytest

from serve_app.engine.stream_server import StreamServer, pump
from serve_app.errors import APIError
from serve_app.router.relay import Exchange, open_byte_stream, relay_events
from serve_app.telemetry.timing import ROUTE_CHAT

EVENTS = [
    'data: {"id":"chatcmpl-1","created":7,"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
    'data: {"id":"chatcmpl-1","created":7,"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n',
]
TRAILER = {
    "engine_timing": {"queue_ms": 1.0, "prefill_ms": 2.0, "decode_ms": 3.0},
    "usage": {"prompt_tokens": 4, "completion_tokens": 2},
    "finish_reasons": ["length"],
    "replica": "r1",
    "complete": True,
}


class FakeHandleStream:
    """What ``handle.chat.remote()`` returns, after its head: the trailer once the replica is done."""

    def __init__(self, done: asyncio.Event, trailer=TRAILER):
        self.done, self.trailer, self.cancelled = done, trailer, False

    async def __anext__(self):
        await self.done.wait()
        return {"trailer": self.trailer}

    def cancel(self):
        self.cancelled = True


async def _replica(server: StreamServer, ticket, future, events, done: asyncio.Event, hold: asyncio.Event | None = None):
    """The replica's side of one stream, as ``ModelServer._serve`` runs it: wait for the router,
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


async def _start(events, *, hold=None, trailer=TRAILER):
    server = StreamServer("127.0.0.1")
    await server.start()
    ticket, future = server.expect()
    done = asyncio.Event()
    replica = asyncio.create_task(_replica(server, ticket, future, events, done, hold))
    stream = FakeHandleStream(done, trailer)
    head = {"status": 200, "stream": True, "socket": server.address, "ticket": ticket}
    socket = await open_byte_stream(stream, head, "m")
    exchange = Exchange(ROUTE_CHAT, {}, region="local", replica="router-1")
    exchange.record.model = "m"
    return server, replica, stream, socket, exchange


async def _collect(events, **kwargs) -> tuple[bytes, Exchange, FakeHandleStream]:
    server, replica, stream, socket, exchange = await _start(events, **kwargs)
    relayed = b"".join([chunk async for chunk in relay_events(stream, socket, exchange, client_wants_usage=False)])
    await replica
    server.close()
    return relayed, exchange, stream


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
    relayed, exchange, _ = asyncio.run(_collect(EVENTS[:1], trailer={**TRAILER, "complete": False}))
    text = relayed.decode()
    assert text.startswith(EVENTS[0])
    error = json.loads(text.split("\n\n")[1].removeprefix("data: "))
    assert error["error"]["type"] == "server_error"
    assert error["error"]["message"] == "the model replica failed mid-stream"
    assert text.endswith("data: [DONE]\n\n")
    assert exchange.record.status == 500


def test_a_client_that_leaves_stops_the_replica_at_once_and_its_tokens_are_still_billed():
    generated = {"prompt_tokens": 4, "completion_tokens": 1, "cached_tokens": 0}
    cut = {**TRAILER, "usage": None, "complete": False, "generated": generated}

    async def scenario():
        hold = asyncio.Event()  # the engine stalls after its first token: no write could fail
        server, replica, stream, socket, exchange = await _start(EVENTS * 50, hold=hold, trailer=cut)
        billed = []
        exchange.bill = billed.append
        relay = relay_events(stream, socket, exchange, client_wants_usage=False)
        first = await relay.__anext__()
        assert first.startswith(b"data: ")
        await relay.aclose()  # what Starlette does when the client disconnects
        complete, produced = await asyncio.wait_for(replica, 5)  # the hang-up alone stopped it
        for _ in range(100):
            if billed:
                break
            await asyncio.sleep(0.01)
        server.close()
        return stream, exchange, complete, produced, billed

    stream, exchange, complete, produced, billed = asyncio.run(scenario())
    assert not complete and produced == 1  # nothing more was generated once the router hung up
    assert not stream.cancelled  # the call ended with its trailer, not a cancel
    assert billed == [exchange] and exchange.generated == generated  # billed once, as counted
    assert exchange.record.status == 499


def test_a_wrong_ticket_gets_nothing_and_the_expected_stream_times_out():
    async def scenario():
        server = StreamServer("127.0.0.1")
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
        server = StreamServer("127.0.0.1")
        await server.start()
        address = server.address
        server.close()
        await server._server.wait_closed()
        stream = FakeHandleStream(asyncio.Event())
        with pytest.raises(APIError) as raised:
            await open_byte_stream(stream, {"socket": address, "ticket": "t" * 32}, "m")
        return stream, raised.value

    stream, error = asyncio.run(scenario())
    assert error.status == 503 and error.code == "replica_unavailable"
    assert stream.cancelled


def test_prefetched_starts_the_source_at_once_and_closes_it_while_pending():
    from serve_app.engine.stream_server import Prefetched

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


def test_a_stream_that_ended_with_an_engine_error_is_recorded_as_503_not_200():
    trailer = {**TRAILER, "error_code": "engine_unavailable", "error_status": 503}
    relayed, exchange, _ = asyncio.run(_collect(EVENTS, trailer=trailer))
    assert relayed.decode().endswith("data: [DONE]\n\n")
    assert (exchange.record.status, exchange.record.error_type) == (503, "engine_unavailable")


def test_a_replica_that_never_sends_its_trailer_is_cancelled_and_the_request_still_billed(monkeypatch):
    from serve_app.router import relay

    monkeypatch.setattr(relay, "ABANDONED_TRAILER_WAIT_S", 0.2)

    async def scenario():
        hold = asyncio.Event()
        server, replica, stream, socket, exchange = await _start(EVENTS * 5, hold=hold)
        stream.done = asyncio.Event()  # the handle call never yields its trailer
        billed = []
        exchange.bill = billed.append
        events = relay_events(stream, socket, exchange, client_wants_usage=False)
        await events.__anext__()
        await events.aclose()
        for _ in range(100):
            if billed:
                break
            await asyncio.sleep(0.01)
        await asyncio.wait_for(replica, 5)
        server.close()
        return stream, exchange, billed

    stream, exchange, billed = asyncio.run(scenario())
    assert stream.cancelled and billed == [exchange]
    assert exchange.generated is None and exchange.record.status == 499


def test_a_model_call_is_made_outside_the_requests_cancellation_scope():
    """Serve cancels the handle calls a request made when it is cancelled (its client left),
    filed under the request's internal id: the model call gets an id of its own, and keeps the
    request id of logs and traces (Serve's private request context, as pinned)."""
    from dataclasses import replace

    from ray.serve import context as serve_context

    from serve_app.router.relay import detached_from_request

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
    finally never runs, so the response's end does its work (``abandon_unrelayed``)."""
    from serve_app.router.relay import abandon_unrelayed

    async def scenario():
        hold = asyncio.Event()
        server, replica, stream, socket, exchange = await _start(EVENTS * 5, hold=hold)
        billed = []
        exchange.bill = billed.append
        abandon_unrelayed(stream, socket, exchange)
        abandon_unrelayed(stream, socket, exchange)  # the end is reported once; twice does nothing
        complete, produced = await asyncio.wait_for(replica, 5)  # the replica saw the hang-up
        for _ in range(100):
            if billed:
                break
            await asyncio.sleep(0.01)
        server.close()
        return exchange, billed, complete

    exchange, billed, complete = asyncio.run(scenario())
    assert not complete and billed == [exchange] and exchange.record.status == 499
