"""RelayedStream (serve_app/router/client_socket.py): body chunks straight to uvicorn's connection,
start and end through the ASGI chain; plain ASGI sends where there is no uvicorn behind it."""

import asyncio

from fastapi import FastAPI
from fastapi.testclient import TestClient

from serve_app.router.client_socket import RelayedStream, find_uvicorn_cycle


class RequestResponseCycle:  # stands in for uvicorn's, by name and module, as the finder checks
    def __init__(self):
        self.transport = FakeTransport()
        self.chunked_encoding = True
        self.disconnected = False
        self.flow = FakeFlow()
        self.messages = []

    async def send(self, message):
        self.messages.append(message)


RequestResponseCycle.__module__ = "uvicorn.protocols.http.httptools_impl"


class FakeTransport:
    def __init__(self):
        self.written = []
        self.socket = object()

    def write(self, data):
        self.written.append(data)

    def get_write_buffer_size(self):
        return 0

    def is_closing(self):
        return False

    def get_extra_info(self, name):
        return self.socket if name == "socket" else None


class FakeFlow:
    write_paused = False

    async def drain(self):
        raise AssertionError("not paused: never drained")


def _wrapped(send):
    """Two middleware-like wrappers, as Starlette's and Serve's are."""

    async def inner(message):
        await send(message)

    async def outer(message):
        await inner(message)

    return outer


async def _chunks(items):
    for item in items:
        yield item


def test_the_cycle_is_found_through_the_wrappers_and_nothing_else_qualifies():
    cycle = RequestResponseCycle()
    assert find_uvicorn_cycle(_wrapped(cycle.send)) is cycle

    async def unrelated(message):
        pass

    assert find_uvicorn_cycle(_wrapped(unrelated)) is None


def test_body_chunks_go_to_the_socket_chunk_framed_and_start_and_end_through_asgi():
    cycle = RequestResponseCycle()
    response = RelayedStream(_chunks([b"data: a\n\n", b"", b"data: b\n\n"]), media_type="text/event-stream")
    asyncio.run(response.stream_response(_wrapped(cycle.send)))
    assert cycle.transport.written == [b"9\r\ndata: a\n\n\r\n", b"9\r\ndata: b\n\n\r\n"]
    assert [m["type"] for m in cycle.messages] == ["http.response.start", "http.response.body"]
    assert cycle.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_client_that_left_stops_the_relay_and_closes_its_source():
    cycle = RequestResponseCycle()
    closed = []

    async def source():
        try:
            yield b"one"
            cycle.disconnected = True
            yield b"two"
            yield b"three"
        finally:
            closed.append(True)

    asyncio.run(RelayedStream(source()).stream_response(_wrapped(cycle.send)))
    assert cycle.transport.written == [b"3\r\none\r\n"] and closed == [True]


def test_a_silent_event_stream_sends_keep_alive_comments_between_events_and_never_inside_one():
    """A proxy tells the router its client left only when a write fails: a stream the engine is
    silent on (queued, or a long prefill) writes an SSE comment every ``keepalive_s``, always at
    an event's end, never while the stream writes, and none once it has ended."""
    cycle = RequestResponseCycle()
    period = 0.05

    async def source():
        await asyncio.sleep(period * 2.5)  # silent before its first byte: comments
        yield b"data: a\n\n"
        for _ in range(6):  # busy: a chunk well within every period, so no comment
            await asyncio.sleep(period / 4)
            yield b"data: b\n\n"
        yield b"data: par"  # half an event, then silence: no comment may split it
        await asyncio.sleep(period * 2.5)
        yield b"t\n\n"

    async def run():
        response = RelayedStream(source(), media_type="text/event-stream", keepalive_s=period)
        await response.stream_response(_wrapped(cycle.send))
        written = list(cycle.transport.written)
        await asyncio.sleep(period * 3)  # after the end: nothing more
        return written

    written = asyncio.run(run())
    comment = b"e\r\n: keep-alive\n\n\r\n"
    assert written == cycle.transport.written
    body = [w for w in written if w != comment]
    assert body == [b"9\r\ndata: a\n\n\r\n"] + [b"9\r\ndata: b\n\n\r\n"] * 6 + [b"9\r\ndata: par\r\n", b"3\r\nt\n\n\r\n"]
    first = written.index(b"9\r\ndata: a\n\n\r\n")
    assert 1 <= written[:first].count(comment) <= 2  # while the engine was silent
    assert comment not in written[first:]  # busy, then inside an event: none


def test_a_stream_that_is_not_an_event_stream_gets_no_comment():
    cycle = RequestResponseCycle()

    async def source():
        await asyncio.sleep(0.15)
        yield b"raw"

    asyncio.run(RelayedStream(source(), media_type="application/octet-stream", keepalive_s=0.05)
                .stream_response(_wrapped(cycle.send)))
    assert cycle.transport.written == [b"3\r\nraw\r\n"]


def test_without_uvicorn_behind_it_the_same_bytes_go_through_asgi():
    app = FastAPI()

    @app.get("/s")
    async def stream():
        return RelayedStream(_chunks([b"data: a\n\n", b"data: [DONE]\n\n"]), media_type="text/event-stream")

    response = TestClient(app).get("/s")
    assert response.status_code == 200 and response.content == b"data: a\n\ndata: [DONE]\n\n"


class StalledFlow:
    """uvicorn's flow control with a client that stopped reading: paused, never drained."""

    write_paused = True

    async def drain(self):
        await asyncio.Event().wait()


def test_a_client_that_stops_reading_ends_the_stream_after_the_stall_timeout_and_is_cut():
    cycle = RequestResponseCycle()
    cycle.flow = StalledFlow()
    closed = []
    cycle.transport.close = lambda: closed.append("transport")

    async def source():
        try:
            while True:
                yield b"data: token\n\n"
        finally:
            closed.append("source")  # the relay's finally: hang-up, the engine stops, billed

    response = RelayedStream(source(), stall_timeout_s=0.05)
    asyncio.run(asyncio.wait_for(response.stream_response(_wrapped(cycle.send)), 5))
    assert closed == ["source", "transport"]
    assert cycle.transport.written == []  # the first write waited for a drain that never came
    assert cycle.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_with_real_uvicorn_a_client_that_stops_reading_is_cut_and_its_stream_ended():
    """A half-open client (its socket open, nothing read: ``requests`` after a read timeout)
    against a real uvicorn: the stall bound ends the stream (its source's finally: for the relay,
    the hang-up that stops the engine) and cuts the connection."""
    import socket
    import threading
    import time

    import uvicorn

    ended = threading.Event()

    async def source():
        try:
            while True:
                yield b"data: " + b"x" * 1000 + b"\n\n"
                await asyncio.sleep(0)
        finally:
            ended.set()

    app = FastAPI()

    @app.get("/s")
    async def stream():
        return RelayedStream(source(), media_type="text/event-stream", stall_timeout_s=0.5)

    listener = socket.socket()  # bound here: no other process can take the port before uvicorn listens
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http="httptools"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n")
        assert client.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        assert ended.wait(10), "the stream went on for a client that stopped reading"
        client.settimeout(5)
        cut = False
        try:
            while client.recv(1 << 16):  # what was buffered, then the cut connection's end
                pass
            cut = True
        except ConnectionResetError:
            cut = True
        assert cut
        client.close()
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_connection_is_handed_over_only_with_nothing_of_the_routers_still_to_go_out():
    """A resumed stream's continuation would overtake keep-alive comments the router wrote to a
    slow client during the seam: it is relayed, not handed over, while any wait in the transport."""
    from serve_app.router.client_socket import ClientLink

    buffered, closing = [0], [False]
    link = ClientLink(socket="the client's socket", pending=lambda: buffered[0], closing=lambda: closing[0])
    assert link.idle_socket() == "the client's socket"
    buffered[0] = 26  # ": keep-alive" frames not yet in the kernel
    assert link.idle_socket() is None
    buffered[0], closing[0] = 0, True  # the client left: a closed transport holds nothing, and no socket
    assert link.idle_socket() is None
    assert ClientLink().idle_socket() is None  # never handed: TLS, a test client
