"""The router's uvicorn server ticks once a second and exits at once (serve_app/runtime/http_tick.py)."""

import asyncio
import socket
import threading

import httpx
import pytest
import uvicorn
import uvloop

from serve_app.runtime import http_tick


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def ticking(monkeypatch):
    """``install`` on this test's uvicorn, undone afterwards (other tests run uvicorn as it ships)."""
    monkeypatch.setattr(uvicorn.Server, "main_loop", uvicorn.Server.main_loop)
    monkeypatch.setattr(uvicorn.Server, "should_exit", None, raising=False)
    monkeypatch.delattr(uvicorn.Server, "should_exit")
    http_tick.install()
    ticks = []
    on_tick = uvicorn.Server.on_tick

    async def counted(self, counter):
        ticks.append(counter)
        return await on_tick(self, counter)

    monkeypatch.setattr(uvicorn.Server, "on_tick", counted)
    return ticks


async def _serving(server: uvicorn.Server) -> tuple[asyncio.Task, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return task, sock.getsockname()[1]


def _server() -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(_app, lifespan="off", access_log=False, log_level="critical"))


def test_idle_server_does_not_wake_ten_times_a_second_and_serves_with_a_date(ticking, monkeypatch):
    async def scenario():
        monkeypatch.setattr(http_tick, "TICK_S", 0.3)
        server = _server()
        task, port = await _serving(server)
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port}/")
        assert response.text == "ok" and response.headers["date"]
        await asyncio.sleep(1.0)
        # uvicorn's own loop would have ticked ~10 times by now; every tick refreshes the header.
        assert 2 <= len(ticking) <= 6 and all(counter % 10 == 0 for counter in ticking)
        server.should_exit = True
        await asyncio.wait_for(task, 5)

    uvloop.run(scenario())


@pytest.mark.parametrize("from_thread", [False, True], ids=["on the loop", "from another thread"])
def test_exit_set_does_not_wait_for_the_tick(ticking, monkeypatch, from_thread):
    async def scenario():
        monkeypatch.setattr(http_tick, "TICK_S", 60.0)
        server = _server()
        task, _port = await _serving(server)
        await asyncio.sleep(0.2)  # the loop waits on its tick
        if from_thread:
            setter = threading.Thread(target=setattr, args=(server, "should_exit", True))
            setter.start()
            setter.join()
        else:
            server.should_exit = True  # as Serve's drain and shutdown do
        await asyncio.wait_for(task, 10)
        assert server.should_exit is True and len(ticking) == 2  # the first tick, and the one that saw the exit

    uvloop.run(scenario())


def test_exit_set_after_a_tick_read_it_and_before_the_wait_is_not_left_for_the_next_tick(ticking, monkeypatch):
    """From another thread, the flag can be set after ``on_tick`` said "go on" and before the new
    tick's waiter exists (its wake-up then goes to the old waiter): the loop must look again."""
    async def scenario():
        monkeypatch.setattr(http_tick, "TICK_S", 60.0)
        server = _server()
        counted = uvicorn.Server.on_tick

        async def racing(self, counter):
            go_on = await counted(self, counter)
            if len(ticking) == 2:
                self.__dict__[http_tick._FLAG] = True  # as a set from another thread that woke no waiter
            return go_on

        monkeypatch.setattr(uvicorn.Server, "on_tick", racing)
        task, _port = await _serving(server)
        await asyncio.sleep(0.1)
        server.__dict__[http_tick._WAITER].set_result(None)  # the first tick ends (as its timer would)
        await asyncio.wait_for(task, 10)  # not the next 60 s tick
        assert len(ticking) == 3

    uvloop.run(scenario())
