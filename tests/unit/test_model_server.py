"""The model replica (``ModelServer``) and the router's relay on a fake engine: no Ray, no vLLM.

The replica's methods are called as Serve's handle calls them (async generators: a head, then for
a stream a trailer), its stream listener and the router's relay talk over a real loopback socket,
and the engine is ``fake_engine.FakeEngine`` behind the real protocol (``engine/protocol.py``).
"""

import asyncio
import json
from dataclasses import replace

import pytest

from fake_engine import PROMPT_TOKENS, FakeEngine
from router_app import InProcessHandle, bare_context, model_server
from serve_app.router import relay
from serve_app.router.call import ReplicaCall
from serve_app.wire.messages import Accepted, Answer, Call, Generated, StreamOpen, Trailer

MODEL = "qwen-3.6-35b-a3b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


pytestmark = pytest.mark.usefixtures("stream_loopback")


_server = model_server


async def _answered(engine: FakeEngine, body: dict):
    """The replica's first item and its answer, read as the router reads them (it connects to the
    hang-up line an ``Accepted`` names)."""
    call = ReplicaCall(InProcessHandle(await _server(engine)).chat, Call(body, "req-1"), MODEL, "local")
    first = await call.first()
    return first, await call.answer()


def test_an_engine_is_started_at_construction_and_shut_down_with_the_replica():
    engine = FakeEngine()
    server = asyncio.run(_server(engine))
    assert engine.started and not engine.stopped
    server.__del__()
    assert engine.stopped


def test_a_json_answer_rides_in_the_head_with_its_trailer_and_the_replicas_own_time():
    async def scenario():
        return await _answered(FakeEngine(), dict(CHAT))

    accepted, head = asyncio.run(scenario())
    assert isinstance(accepted, Accepted)  # a generating request is under way first: a hang-up line
    assert head.status == 200
    assert head.body["choices"][0]["message"]["content"] == "t1 t2 t3 "
    # The router subtracts the replica's own time from its handle wait (Serve's queue).
    assert head.replica_ms >= 0
    summary = head.trailer
    assert summary.usage["completion_tokens"] == 3 and summary.replica == "unserved"
    assert summary.generated == Generated(prompt_tokens=PROMPT_TOKENS, completion_tokens=3, cached_tokens=0)


def test_a_refusal_is_a_head_with_its_status_and_no_trailer():
    async def scenario():
        return await _answered(FakeEngine(refuse=400), dict(CHAT))

    accepted, head = asyncio.run(scenario())
    assert isinstance(accepted, Accepted)
    assert head.status == 400 and head.body["error"]["param"] == "messages" and head.trailer is None


@pytest.mark.parametrize("dies, status, code", [(True, 503, "engine_unavailable"), (False, 500, "internal")])
def test_an_engine_failure_before_the_answer_is_an_error_head_never_an_exception(dies, status, code):
    async def scenario():
        call = ReplicaCall(InProcessHandle(await _server(FakeEngine(fail_before=True, dies=dies))).chat, Call(dict(CHAT), "req-1"), MODEL, "local")
        first = await call.first()
        return first, await call._items.__anext__()  # read as it comes: the router would fail over on 503

    accepted, head = asyncio.run(scenario())
    assert isinstance(accepted, Accepted)
    assert (head.status, head.body["error"]["code"]) == (status, code)


async def _relay(engine: FakeEngine, body: dict, *, leave_after: int | None = None):
    """Router side, as the pipeline runs it: the call, the socket, the relay to a client that
    reads everything or leaves after ``leave_after`` chunks."""
    server = await _server(engine)
    ctx = bare_context(model=MODEL)
    handle = InProcessHandle(server)
    ctx.call = ReplicaCall(handle.chat, Call(body, ctx.id), MODEL, "local")
    await ctx.call.first()
    events = relay.events(ctx)
    chunks = []
    async for chunk in events:
        chunks.append(chunk)
        if leave_after is not None and len(chunks) == leave_after:
            await events.aclose()  # the client disconnects
            break
    for _ in range(200):
        if ctx.services.meter.records:
            break
        await asyncio.sleep(0.01)
    server._listener.close()
    return b"".join(chunks).decode(), ctx, ctx.services.meter.records, handle.calls[0]


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
    assert len(billed) == 1 and exchange.generated.completion_tokens == 3
    assert not stream.cancelled


def test_a_client_that_leaves_aborts_the_engine_and_the_trailer_bills_what_was_generated():
    engine = FakeEngine(tokens=1000, latency_s=0.005)
    body = {**CHAT, "stream": True, "max_tokens": 1000}
    _, exchange, billed, stream = asyncio.run(_relay(engine, body, leave_after=3))
    assert len(billed) == 1 and exchange.record.status == 499
    generated = exchange.generated.completion_tokens
    assert 2 <= generated < 1000 and generated == engine.generated  # what the engine really did
    assert engine.closed_early == 1  # aborted, not run to max_tokens
    assert not stream.cancelled  # ended by its trailer


def test_an_engine_that_dies_mid_stream_ends_it_with_a_503_event_and_counts_its_tokens():
    engine = FakeEngine(tokens=10, fail_after=2, dies=True)
    text, exchange, billed, _ = asyncio.run(_relay(engine, {**CHAT, "stream": True, "max_tokens": 10}))
    error = json.loads(_events(text)[-2][6:])
    assert error["error"]["code"] == "engine_unavailable" and _events(text)[-1] == "data: [DONE]"
    assert exchange.record.status == 503
    assert len(billed) == 1 and exchange.generated.completion_tokens == 2


def test_a_call_cancelled_at_its_head_closes_the_engine_request_and_forgets_its_ticket():
    engine = FakeEngine(tokens=1000, latency_s=0.005)

    async def scenario():
        server = await _server(engine)
        call = server.chat(Call({**CHAT, "stream": True, "max_tokens": 1000}, "req-1"))
        head = await call.__anext__()
        await asyncio.sleep(0.05)  # the engine is generating (prefetched) while the head travels
        await call.aclose()  # Serve's cancellation reaches the generator at the head's yield
        server._listener.close()
        return head, server

    head, server = asyncio.run(scenario())
    assert isinstance(head, StreamOpen) and engine.closed_early == 1  # aborted, not run to max_tokens
    assert server._listener._expected == {}
