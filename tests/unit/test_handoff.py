"""The hand-off (serve_app/wire/handoff.py): the router gives a replica on its node the client's
connection, and the replica writes the stream to it. Real uvicorn (the router's HTTP server, whose
connection is handed over), a real ``ModelServer`` on the fake engine, a real HTTP client: the
client must get exactly what a relayed stream gives it, with no byte of the engine's stream
passing through the router.
"""

import asyncio
import json
import socket

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from fake_engine import FakeEngine
from router_app import InProcessHandle, bare_context, model_server
from serve_app.router import relay
from serve_app.router.call import ReplicaCall
from serve_app.wire import handoff
from serve_app.wire.messages import Call

MODEL = "qwen-3.6-35b-a3b"
STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}


pytestmark = pytest.mark.usefixtures("stream_loopback")


@pytest.fixture
def writes(monkeypatch):
    """How many writes the replica made to a handed-over client, and how many reads the router
    relayed (``relay.events`` yields each)."""
    seen = {"replica": 0, "handed": 0}
    write = handoff.ClientWriter.write

    def counted(self, data):
        seen["replica"] += 1
        return write(self, data)

    monkeypatch.setattr(handoff.ClientWriter, "write", counted)
    return seen


async def _serve(engine: FakeEngine, *, hand_off: bool = True):
    """A uvicorn server whose one route runs a stream as the pipeline does (the call, its head,
    the relay); returns the server, its task, its URL and what each request's context was."""
    replica = await model_server(engine)
    contexts = []

    async def route(request):
        body = json.loads(await request.body())
        ctx = bare_context(model=MODEL)
        ctx.services.hand_off = hand_off
        ctx.call = ReplicaCall(InProcessHandle(replica).chat, Call(body, ctx.id), MODEL, "local")
        contexts.append(ctx)
        await ctx.call.first()
        return relay.stream(ctx)

    app = Starlette(routes=[Route("/", route, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return replica, server, task, f"http://127.0.0.1:{port}/", contexts


async def _stop(replica, server, task) -> None:
    server.should_exit = True
    await task
    replica._listener.close()


async def _until_billed(ctx) -> None:
    for _ in range(300):
        if ctx.services.meter.records:
            return
        await asyncio.sleep(0.01)


def _events(text: str) -> list[str]:
    return [event for event in text.split("\n\n") if event and not event.startswith(":")]


async def _stream(engine: FakeEngine, body: dict, *, hand_off: bool = True, read: int | None = None):
    """The client's text (all of it, or its first ``read`` bytes, then it hangs up) and the
    request's context, once billed."""
    replica, server, task, url, contexts = await _serve(engine, hand_off=hand_off)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            async with client.stream("POST", url, json=body) as response:
                assert response.status_code == 200
                assert response.headers["transfer-encoding"] == "chunked"
                text = b""
                async for chunk in response.aiter_raw():
                    text += chunk
                    if read is not None and len(text) >= read:
                        break
        await _until_billed(contexts[0])
    finally:
        await _stop(replica, server, task)
    return text.decode(), contexts[0]


def test_a_handed_over_stream_reaches_the_client_whole_with_the_routers_closing_after_it(writes):
    text, ctx = asyncio.run(_stream(FakeEngine(tokens=6), STREAM))
    events = _events(text)
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events if e.startswith("data: {")]
    assert contents[:7] == ["", "t1 ", "t2 ", "t3 ", "t4 ", "t5 ", "t6 "]
    # The router's closing comes after every byte the replica wrote, named after its first event.
    assert events[-2].startswith("event: pg_metadata") and events[-1] == "data: [DONE]"
    first_id = json.loads(events[0][6:])["id"]
    assert json.loads(events[-2].split("data: ", 1)[1])["id"] == first_id
    assert writes["replica"] >= 7 and ctx.call.handed  # the replica wrote the engine's events
    assert ctx.record.status == 200
    assert ctx.record.output_tokens == 6 and len(ctx.services.meter.records) == 1


def test_with_the_hand_off_off_the_router_relays_and_the_client_gets_the_same_events(writes):
    handed, _ = asyncio.run(_stream(FakeEngine(tokens=6), STREAM))
    by_the_replica = writes["replica"]
    relayed, ctx = asyncio.run(_stream(FakeEngine(tokens=6), STREAM, hand_off=False))
    assert by_the_replica >= 7 and writes["replica"] == by_the_replica and not ctx.call.handed
    strip = lambda text: [e for e in _events(text) if not e.startswith("event: pg_metadata")]  # noqa: E731
    same = lambda events: [json.loads(e[6:]).get("choices") for e in events if e.startswith("data: {")]  # noqa: E731
    assert same(strip(handed)) == same(strip(relayed)) and ctx.record.status == 200


def test_a_client_that_leaves_a_handed_over_stream_aborts_the_engine_and_is_billed_what_it_generated():
    engine = FakeEngine(tokens=1000, latency_s=0.005)
    _, ctx = asyncio.run(_stream(engine, {**STREAM, "max_tokens": 1000}, read=300))
    assert ctx.record.status == 499 and len(ctx.services.meter.records) == 1
    assert engine.closed_early == 1  # aborted, not run to max_tokens
    generated = ctx.generated.completion_tokens
    assert 1 <= generated < 1000 and generated == engine.generated


def test_an_engine_that_dies_mid_handed_over_stream_ends_it_with_the_error_event_after_its_tokens():
    text, ctx = asyncio.run(_stream(FakeEngine(tokens=10, fail_after=2, dies=True), {**STREAM, "max_tokens": 10}))
    events = _events(text)
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert contents == ["", "t1 ", "t2 "]  # every byte the replica wrote, framed whole
    assert json.loads(events[-2][6:])["error"]["code"] == "engine_unavailable" and events[-1] == "data: [DONE]"
    assert ctx.record.status == 503 and ctx.generated.completion_tokens == 2


def test_a_router_that_keeps_the_bytes_gets_what_the_client_has_in_the_trailer_of_a_broken_stream():
    """A resumable (or Responses) stream: the continuation starts after what the client has."""

    async def scenario():
        replica = await model_server(FakeEngine(tokens=10, fail_after=3, dies=True))
        call = ReplicaCall(InProcessHandle(replica).chat, Call({**STREAM, "max_tokens": 10}, "r1"), MODEL, "local")
        await call.first()
        ours, theirs = socket.socketpair()
        try:
            assert call.present(theirs, keep=True, stall_s=5)
            while await call.reader.read(65536):
                pass
            trailer = await call.trailer()
            ours.setblocking(False)
            received = b""
            while True:
                try:
                    received += ours.recv(65536)
                except BlockingIOError:
                    break
        finally:
            ours.close()
            theirs.close()
            replica._listener.close()
        return trailer, received

    trailer, received = asyncio.run(scenario())
    assert not trailer.complete and trailer.error_code == "engine_unavailable" and not trailer.client_gone
    assert trailer.written and trailer.written.count(b"data: ") == 4  # the role chunk and three tokens
    # The client got exactly those bytes, each write one HTTP chunk.
    assert _dechunk(received) == trailer.written


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        out, data = out + rest[:n], rest[n + 2:]
    return out


def test_a_keep_alive_due_while_a_frames_rest_is_sent_never_lands_inside_that_frame():
    """A slow client: the kernel took part of a chunk, ``drain`` sends the rest. A keep-alive tick
    meanwhile, at a moment the client has just read (room in the kernel's buffer), went out
    before that rest: a comment inside a chunk, the client's HTTP framing broken."""
    replica, client = socket.socketpair()
    replica.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    events = [b"data: " + bytes([97 + i % 26]) * 600_000 + b"\n\n" for i in range(3)]

    client.setblocking(False)

    def read(size: int) -> bytes:
        try:
            return client.recv(size)
        except BlockingIOError:
            return b""

    async def scenario() -> bytes:
        writer = handoff.ClientWriter(replica.detach(), keep=False, stall_s=30, first_to=None)
        received = bytearray()
        for event in events:
            writer.write(event)
            assert writer.must_drain()  # the kernel took part of it
            draining = asyncio.ensure_future(writer.drain())
            await asyncio.sleep(0)  # its send took what fits, and waits for room
            while not draining.done():
                received += read(65536)  # room now, before the loop sends more of the rest
                writer.keep_alive(), writer.keep_alive()  # the first tick after a write is skipped
                await asyncio.sleep(0)
            await draining
        writer.close()
        while chunk := read(65536):
            received += chunk
        return bytes(received)

    received = asyncio.run(scenario())
    chunks, at = [], 0
    while at < len(received):  # HTTP/1.1 chunked framing: size, CRLF, data, CRLF
        size_end = received.index(b"\r\n", at)
        size = int(received[at:size_end], 16)
        chunks.append(received[size_end + 2: size_end + 2 + size])
        assert received[size_end + 2 + size: size_end + 4 + size] == b"\r\n", "a chunk's framing was broken"
        at = size_end + 4 + size
    assert [c for c in chunks if not c.startswith(b":")] == events


def test_a_stream_whose_engine_generator_fails_to_close_still_closes_its_ticket(monkeypatch):
    """Every way out of a replica's stream closes its socket and ticket, also when closing the
    engine's generator raises (or is cancelled again): a ticket left waiting, and with the hand-off
    a writer left writing keep-alives into a connection the router has taken back."""
    from serve_app.engine.prefetch import Prefetched
    from serve_app.surfaces import SURFACES
    from serve_app.wire.messages import StreamOpen

    async def failing_close(self):
        raise RuntimeError("vLLM's generator raised on close")

    async def scenario():
        replica = await model_server(FakeEngine(tokens=4))
        monkeypatch.setattr(Prefetched, "aclose", failing_close)
        chat = next(surface for surface in SURFACES if surface.name == "chat")
        items = replica._answer(chat, Call(STREAM, "req-1"))
        head = await items.__anext__()
        with pytest.raises(RuntimeError):
            await items.aclose()  # the router went away at the head
        left = dict(replica._listener._expected)
        replica._listener.close()
        return head, left

    head, left = asyncio.run(scenario())
    assert isinstance(head, StreamOpen) and left == {}


def test_the_listener_closes_a_connection_with_an_unknown_ticket_and_the_descriptor_it_sent():
    async def scenario():
        replica = await model_server(FakeEngine())
        address = replica._listener.local
        ours, theirs = socket.socketpair()
        try:
            sock = await handoff.connect(address)
            handoff.present(sock.fileno(), "f" * 32, "H", 5, theirs)
            sock.setblocking(True)
            sock.settimeout(5)
            closed = await asyncio.to_thread(sock.recv, 1)  # the replica closes without a byte
            sock.close()
            theirs.close()
            await asyncio.sleep(0.05)
            ours.settimeout(5)
            eof = ours.recv(1)  # every copy of the client's end is closed: the replica kept none
        finally:
            ours.close()
            replica._listener.close()
        return closed, eof

    closed, eof = asyncio.run(scenario())
    assert closed == b"" and eof == b""


def test_the_line_round_trips_and_a_malformed_one_is_refused():
    ticket = "a" * 32
    assert handoff.parse_line(handoff.line(ticket, "K", 30)) == (ticket, "K", 30.0)
    assert handoff.parse_line(handoff.line(ticket, "S", 0.25)) == (ticket, "S", 0.25)
    for bad in (b"short\n", ticket.encode() + b"X10\n", ticket.encode() + b"H\n", ticket.encode() + b"H1x\n"):
        assert handoff.parse_line(bad) is None
    assert handoff.local_address().startswith("\0") and handoff.local_address() != handoff.local_address()


def test_the_hand_off_is_off_unless_the_region_turns_it_on_and_the_router_reads_it_from_its_settings():
    from types import SimpleNamespace

    from serve_app.config import RouterArgs
    from serve_app.router.services import _call_settings

    assert RouterArgs().hand_off_streams is False
    assert _call_settings(SimpleNamespace(router=RouterArgs()))["hand_off"] is False
    assert _call_settings(SimpleNamespace(router=RouterArgs(hand_off_streams=True)))["hand_off"] is True
