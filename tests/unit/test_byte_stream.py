"""The byte path between a model replica and the router, without Ray: the replica's stream listener
(serve_app/engine/stream_server.py) and the router's relay (serve_app/router/relay.py) over a real
loopback socket, with the handle call stood in for by a small fake that yields the trailer."""

import asyncio
import json

import pytest

from serve_app.engine.stream_server import StreamServer
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
    """The replica's side of one stream: wait for the router, write each event, close."""
    connection = await server.accept(ticket, future)
    written = 0
    for event in events:
        if not connection.write(event.encode()):
            break
        written += 1
        try:
            await connection.drain()
        except ConnectionError:  # the router closed the socket
            break
        if hold is not None:
            await hold.wait()
    connection.close()
    done.set()
    return written


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


def test_a_client_that_leaves_closes_the_socket_and_cancels_the_replica_call():
    async def scenario():
        hold = asyncio.Event()
        server, replica, stream, socket, exchange = await _start(EVENTS * 50, hold=hold)
        relay = relay_events(stream, socket, exchange, client_wants_usage=False)
        first = await relay.__anext__()
        assert first.startswith(b"data: ")
        await relay.aclose()  # what Starlette does when the client disconnects
        hold.set()
        written = await asyncio.wait_for(replica, 5)
        server.close()
        return stream, exchange, written

    stream, exchange, written = asyncio.run(scenario())
    assert stream.cancelled
    assert exchange.record.status == 499
    assert written < 100  # the replica stopped writing once the router's socket was gone


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
