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
import warnings

import pytest
import uvloop

from auth_support import MODEL, bearer
from fake_engine import FakeEngine
from serve_app.wire import handoff

ASK = [{"role": "user", "content": "count"}]


def _open_sockets() -> int:
    """This process's open socket descriptors (the router's and the replica's ends alike)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return count


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
    if loop == "uvloop":  # the defect, as it was: the socket object and libuv both closed the number
        assert not run(_collected_open(_plain))


def _requests(app, key) -> None:
    for stream in (False, True):
        response = app.client.post("/v1/chat/completions", headers=bearer(key),
                                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": stream})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("transport", ["handle", "direct"])
def test_requests_leave_no_connection_to_their_replica_open(router_app, transport):
    app = router_app(engine=FakeEngine(tokens=4))
    app.services.handle_transport = transport
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    _requests(app, key)  # the first of each: pools, the direct line's kept connection
    gc.collect()
    gc.disable()  # a connection only the collector would close counts as open
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always", ResourceWarning)
            before = _open_sockets()
            for _ in range(4):
                _requests(app, key)
            app.recorded()  # every request settled, its last item read
            after = _open_sockets()
    finally:
        gc.enable()
    assert after == before
    # Nor one that its objects' finalizers closed as they were dropped (asyncio warns then).
    assert [str(w.message) for w in warned if "unclosed" in str(w.message)] == []
