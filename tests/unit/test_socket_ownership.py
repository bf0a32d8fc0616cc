"""Every connection the router opens to a model replica ends with its request (``router/call.py``),
and a Unix connection's descriptor has one owner (``wire/handoff.open_streams``).

The defect these hold: a connection to a replica's Unix listener that nothing closed stayed open
until the garbage collector found its request's reference cycle. The Python socket object and
uvloop's transport (the loop of every Ray actor here) both owned its descriptor: the socket's
finalizer closed it, the number went to the router's next accepted client, and libuv's own close,
a loop turn later, closed that client's connection (uvicorn: EBADF in ``connection_made``).
"""

import asyncio
import gc
import os
import socket

import pytest
import uvloop

from auth_support import MODEL, bearer
import fake_vllm
from fake_engine import FakeEngine
from serve_app.wire import handoff
from serve_app.wire.socket import Listener

ASK = [{"role": "user", "content": "count"}]


async def _collected_open(with_streams) -> bool:
    """Open a Unix connection, let the peer close it, drop it unclosed in a reference cycle,
    collect it, take a new descriptor (as an accept would) and run the loop on: True when that
    descriptor is still open."""
    address = handoff.local_address()
    server = await asyncio.start_unix_server(lambda _reader, writer: writer.close(), address)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, address)
        reader, writer = await with_streams(sock)
        await reader.read()  # the peer closed: the transport stays open, half-closed, not reading

        class Request:  # a request's objects, in a cycle as a request's are (tasks, closures)
            pass

        request = Request()
        request.connection, request.sock, request.me = (reader, writer), sock, request
        del reader, writer, sock, request
        gc.collect()
        victim = os.open("/dev/null", os.O_RDONLY)
        try:
            for _ in range(5):
                await asyncio.sleep(0)
            os.fstat(victim)
            return True
        except OSError:
            return False
        finally:
            try:
                os.close(victim)
            except OSError:
                pass
    finally:
        server.close()


async def _plain(sock):
    return await asyncio.open_unix_connection(sock=sock)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_unix_connection_collected_open_never_closes_a_descriptor_that_came_after_it(loop):
    run = uvloop.run if loop == "uvloop" else asyncio.run
    assert run(_collected_open(handoff.open_streams))
    if loop == "uvloop":
        # The scenario is the defect's, as it was with a plain open: the socket object and libuv
        # both closed the number. (A thread taking the number first would hide it once: tried
        # thrice. If uvloop ever closes once on its own, this fails, and the detach may go.)
        assert not all(run(_collected_open(_plain)) for _ in range(3))


@pytest.fixture
def opened(monkeypatch):
    """Every connection ``handoff.open_streams`` opened (the router's and the replica's ends), kept
    alive here so that none is closed by its objects being dropped: only by the code."""
    writers = []

    async def spied(sock):
        reader, writer = await open_streams(sock)
        writers.append(writer)
        return reader, writer

    open_streams = handoff.open_streams
    monkeypatch.setattr(handoff, "open_streams", spied)
    return writers


def _chat(app, key, *, stream: bool):
    response = app.client.post("/v1/chat/completions", headers=bearer(key),
                               json={"model": MODEL, "messages": ASK, "max_tokens": 12, "stream": stream})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("transport", ["handle", "direct"])
def test_every_connection_to_a_replica_is_closed_when_its_request_ends(router_app, opened, transport, loop):
    app = router_app(engine=FakeEngine(tokens=4), uvloop=loop == "uvloop")
    app.services.handle_transport = transport
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    for _ in range(2):
        _chat(app, key, stream=False)  # its connection is only the hang-up line: nothing reads it
        _chat(app, key, stream=True)
    app.recorded()  # every request settled, its last item read
    assert opened and [writer for writer in opened if not writer.is_closing()] == []


def test_a_resumed_streams_earlier_connection_is_closed_too(router_app, opened):
    fake_vllm.import_vllm()  # the continuation's replay makes vLLM's objects: not on the resume's clock
    app = router_app(engine=FakeEngine(tokens=12, fail_after=5, dies=True), replicas=(FakeEngine(tokens=12),))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    events = _chat(app, key, stream=True).text
    assert '"resumes":1' in events.replace(" ", "")  # the stream went on on the second replica
    app.recorded()
    assert len(opened) >= 4 and [writer for writer in opened if not writer.is_closing()] == []


def test_a_handed_over_client_whose_call_ended_while_the_router_connected_is_closed_not_kept():
    """The replica forgot the ticket (its call ended at the head's yield) while a router connecting
    for it handed the client's connection over: the replica closes its copy at once, and writes
    nothing to it (no keep-alive comments into a connection that is not its)."""

    async def scenario():
        listener = Listener("127.0.0.1")
        await listener.start()
        ticket, _ = listener.expect()
        opening = handoff.open_streams

        async def forgotten_meanwhile(sock):
            listener.forget(ticket)
            return await opening(sock)

        ours, theirs = socket.socketpair()
        router = await handoff.connect(listener.local)
        try:
            handoff.open_streams = forgotten_meanwhile
            handoff.present(router.fileno(), ticket, "H", 5, theirs)
            theirs.close()  # the router's copy stays ``ours``' peer: only the replica's is open now
            ours.setblocking(False)
            for _ in range(300):  # the replica's copy closed: the client's end reads EOF
                await asyncio.sleep(0.01)
                try:
                    return ours.recv(100)
                except BlockingIOError:
                    continue
            return None
        finally:
            handoff.open_streams = opening
            for sock in (ours, router):
                sock.close()
            listener.close()

    assert asyncio.run(scenario()) == b""
