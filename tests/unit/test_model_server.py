"""The model replica (``ModelServer``) and the router's relay on a fake engine: no Ray, no vLLM.

The replica's methods are called as Serve's handle calls them (async generators: a head, then for
a stream a trailer), its stream listener and the router's relay talk over a real loopback socket,
and the engine is ``fake_engine.FakeEngine`` behind the real protocol (``engine/protocol.py``).
"""

import asyncio
import json

import pytest

from fake_engine import PROMPT_TOKENS, FakeEngine
from serve_app.config import ModelDeploymentArgs
from serve_app.engine.deployment import ModelServer
from serve_app.router.relay import Exchange, call_model, open_byte_stream, relay_events
from serve_app.telemetry.timing import ROUTE_CHAT

MODEL = "qwen-3.6-35b-a3b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    monkeypatch.setenv("SERVE_APP_STREAM_HOST", "127.0.0.1")


async def _server(engine: FakeEngine) -> ModelServer:
    cls = ModelServer.func_or_class
    server = object.__new__(cls)
    await cls.__init__(server, ModelDeploymentArgs(id=MODEL), "/weights", make_engine=lambda args, path: engine)
    return server


class Handle:
    """A DeploymentHandle's ``options(stream=True)`` stand-in that calls the replica in-process."""

    def __init__(self, server: ModelServer):
        self.server = server

    def __getattr__(self, method):
        server = self.server

        class Method:
            def remote(self, body):
                return Call(getattr(server, method)(body))

        return Method()


class Call:
    """One handle call, driven like Serve drives a replica's generator: in a task of its own,
    whoever reads its items; ``cancel`` cancels that task (Serve's cancellation)."""

    _END = object()

    def __init__(self, items):
        self.cancelled = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._drive(items))

    async def _drive(self, items):
        try:
            async for item in items:
                await self._queue.put(item)
        finally:
            await self._queue.put(self._END)

    async def __anext__(self):
        item = await self._queue.get()
        if item is self._END:
            raise StopAsyncIteration
        return item

    def cancel(self):
        self.cancelled = True
        self._task.cancel()


async def _items(server: ModelServer, body: dict) -> list[dict]:
    return [item async for item in server.chat(body)]


def test_an_engine_is_started_at_construction_and_shut_down_with_the_replica():
    engine = FakeEngine()
    server = asyncio.run(_server(engine))
    assert engine.started and not engine.stopped
    server.__del__()
    assert engine.stopped


def test_a_json_answer_rides_in_the_head_with_its_trailer_and_the_replicas_own_time():
    async def scenario():
        return await _items(await _server(FakeEngine()), dict(CHAT))

    (head,) = asyncio.run(scenario())
    assert head["status"] == 200 and head["stream"] is False
    assert head["body"]["choices"][0]["message"]["content"] == "t1 t2 t3 "
    # The router subtracts the replica's own time from its handle wait (Serve's queue).
    assert head["replica_ms"] >= 0
    summary = head["trailer"]
    assert summary["usage"]["completion_tokens"] == 3 and summary["replica"] == "unserved"
    assert summary["generated"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3, "cached_tokens": 0}


def test_a_refusal_is_a_head_with_its_status_and_no_trailer():
    async def scenario():
        return await _items(await _server(FakeEngine(refuse=400)), dict(CHAT))

    (head,) = asyncio.run(scenario())
    assert head["status"] == 400 and head["body"]["error"]["param"] == "messages" and "trailer" not in head


@pytest.mark.parametrize("dies, status, code", [(True, 503, "engine_unavailable"), (False, 500, "internal")])
def test_an_engine_failure_before_the_answer_is_an_error_head_never_an_exception(dies, status, code):
    async def scenario():
        return await _items(await _server(FakeEngine(fail_before=True, dies=dies)), dict(CHAT))

    (head,) = asyncio.run(scenario())
    assert (head["status"], head["body"]["error"]["code"]) == (status, code)


async def _relay(engine: FakeEngine, body: dict, *, leave_after: int | None = None):
    """Router side, as ``inference.relay`` runs it: the call, the socket, the relay to a client
    that reads everything or leaves after ``leave_after`` chunks."""
    server = await _server(engine)
    exchange = Exchange(ROUTE_CHAT, {}, region="local", replica="router-1")
    exchange.record.model = MODEL
    billed = []
    exchange.bill = billed.append
    stream, head = await call_model(Handle(server), "chat", body, "local", exchange)
    socket = await open_byte_stream(stream, head, MODEL)
    relay = relay_events(stream, socket, exchange, client_wants_usage=False)
    chunks = []
    async for chunk in relay:
        chunks.append(chunk)
        if leave_after is not None and len(chunks) == leave_after:
            await relay.aclose()  # the client disconnects
            break
    for _ in range(200):
        if billed:
            break
        await asyncio.sleep(0.01)
    server._streams.close()
    return b"".join(chunks).decode(), exchange, billed, stream


def _events(text: str) -> list[str]:
    return [event for event in text.split("\n\n") if event]


def test_a_stream_reaches_the_client_as_the_engine_wrote_it_then_timing_and_done():
    engine = FakeEngine()
    text, exchange, billed, stream = asyncio.run(_relay(engine, {**CHAT, "stream": True}))
    events = _events(text)
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events if e.startswith("data: {")]
    assert contents[:4] == ["", "t1 ", "t2 ", "t3 "]
    assert events[-2].startswith("event: pg_metadata") and events[-1] == "data: [DONE]"
    assert '"usage"' not in text and '"metrics"' not in text  # asked for by the replica, not shown
    assert exchange.record.status == 200 and exchange.record.output_tokens == 3
    assert billed == [exchange] and exchange.generated["completion_tokens"] == 3
    assert not stream.cancelled


def test_a_client_that_leaves_aborts_the_engine_and_the_trailer_bills_what_was_generated():
    engine = FakeEngine(tokens=1000, latency_s=0.005)
    body = {**CHAT, "stream": True, "max_tokens": 1000}
    _, exchange, billed, stream = asyncio.run(_relay(engine, body, leave_after=3))
    assert billed == [exchange] and exchange.record.status == 499
    generated = exchange.generated["completion_tokens"]
    assert 2 <= generated < 1000 and generated == engine.generated  # what the engine really did
    assert engine.closed_early == 1  # aborted, not run to max_tokens
    assert not stream.cancelled  # ended by its trailer


def test_an_engine_that_dies_mid_stream_ends_it_with_a_503_event_and_counts_its_tokens():
    engine = FakeEngine(tokens=10, fail_after=2, dies=True)
    text, exchange, billed, _ = asyncio.run(_relay(engine, {**CHAT, "stream": True, "max_tokens": 10}))
    error = json.loads(_events(text)[-2][6:])
    assert error["error"]["code"] == "engine_unavailable" and _events(text)[-1] == "data: [DONE]"
    assert exchange.record.status == 503
    assert billed == [exchange] and exchange.generated["completion_tokens"] == 2


def test_a_call_cancelled_at_its_head_closes_the_engine_request_and_forgets_its_ticket():
    engine = FakeEngine(tokens=1000, latency_s=0.005)

    async def scenario():
        server = await _server(engine)
        call = server.chat({**CHAT, "stream": True, "max_tokens": 1000})
        head = await call.__anext__()
        await asyncio.sleep(0.05)  # the engine is generating (prefetched) while the head travels
        await call.aclose()  # Serve's cancellation reaches the generator at the head's yield
        server._streams.close()
        return head, server

    head, server = asyncio.run(scenario())
    assert head["stream"] and engine.closed_early == 1  # aborted, not run to max_tokens
    assert server._streams._expected == {}
