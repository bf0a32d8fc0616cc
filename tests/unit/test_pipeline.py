"""The pipeline's one exit, tried as a client would break it: leaving a non-stream request while
the engine generates, leaving a stream before its first byte; and what a request costs however it
ends (an answer that fails after the engine ran, a refusal after a registry read). The real router
on a fake engine (``router_app.py``), driven below the HTTP client so the client's departure is
exact."""

import asyncio
import json

import pytest
from starlette.requests import Request

from auth_support import MODEL, OTHER_MODEL, TIERS, bearer
from fake_engine import FINAL_ONLY, FakeEngine
from serve_app import surfaces
from serve_app.auth.config import Tier
from serve_app.config import RouterArgs
from serve_app.errors import error_body
from serve_app.router import pipeline
from serve_app.router.context import Context, wait_settled
from serve_app.wire.messages import Answer


def _request(body: dict, key: str, path: str, extra_headers: dict[str, str] | None = None) -> Request:
    raw = json.dumps(body).encode()
    named = {**bearer(key), **(extra_headers or {})}
    headers = [(name.lower().encode(), value.encode()) for name, value in named.items()]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # then nothing more: the client is silent, not gone
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}, receive)


def leave_once(app, surface, body: dict, key: str, engine_is_at_work) -> None:
    """Send ``body`` to ``surface`` and leave, as a client that disconnects, once
    ``engine_is_at_work()`` says so."""

    async def leave():
        served = asyncio.ensure_future(pipeline.run(app.services, _request(body, key, surface.route), surface))
        while not engine_is_at_work():
            await asyncio.sleep(0.01)
        served.cancel()  # what Serve does to the request's task when its client disconnects
        try:
            await served
        except asyncio.CancelledError:
            pass

    app.run(leave)


def test_a_non_stream_request_whose_client_leaves_stops_the_engine_and_is_billed_what_it_generated(router_app):
    engine = FakeEngine(tokens=1000, latency_s=0.01)
    app = router_app(engine=engine)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]}
    leave_once(app, surfaces.CHAT, body, key, lambda: engine.generated >= 5)
    (row,) = app.recorded()
    assert row["status"] == 499
    assert 5 <= row["completion_tokens"] < 1000 and row["completion_tokens"] == engine.generated
    assert engine.closed_early == 1  # aborted, not run to max_tokens
    assert app.services.in_flight.load(MODEL, 1)["in_flight"] == 0


def test_a_half_open_client_frees_its_engine_slot_within_the_stall_bound_and_is_billed(router_app):
    """A client that keeps its socket open and reads nothing (``requests`` after a read timeout),
    through real uvicorn in front of the real router and replica: once a write has waited
    ``router.stall_timeout_s`` the stream ends, the engine request is aborted (its slot free), the
    request is recorded with what was generated, and the connection is cut. Small socket buffers
    on both ends (the listener's are inherited by the connections it accepts) make "stopped
    reading" reach the router after a few KiB rather than a loopback's megabytes."""
    import socket
    import time

    import uvicorn

    from serve_app.router import ingress

    engine = FakeEngine(tokens=8000, latency_s=0.001)
    app = router_app(engine=engine)
    app.services.stall_timeout_s = 0.5
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(ingress.app, log_level="warning", http="httptools", lifespan="off"))
    serving = app.client.portal.start_task_soon(server.serve, [listener])  # on the router's own event loop
    client = socket.socket()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.01)
        body = json.dumps({"model": MODEL, "max_tokens": 8000, "stream": True, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "go on"}]}).encode()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(listener.getsockname())
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert client.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        deadline = time.monotonic() + 30
        while engine.closed_early == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.closed_early == 1, "the engine went on for a client that stopped reading"
        (row,) = app.recorded()
        assert row["status"] == 499 and 0 < row["completion_tokens"] == engine.generated < 8000
        assert app.services.in_flight.load(MODEL, 1)["in_flight"] == 0  # its slot is free
    finally:
        client.close()
        server.should_exit = True
        serving.result(timeout=10)


def test_a_model_method_handle_is_made_once_not_per_request(router_app):
    """Serve's ``handle.<method>`` builds a new handle each time (``DeploymentHandle.options``):
    the router makes each model's method handle once and calls it for every request."""
    app = router_app()
    app.services.handle_transport = "grpc"  # every call through the handle (not a direct line)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True, False):
        answer = app.client.post("/v1/chat/completions", json={**body, "stream": stream}, headers=bearer(key))
        assert answer.status_code == 200
    completions = app.client.post("/v1/completions", json={"model": MODEL, "max_tokens": 4, "prompt": "hi"},
                                  headers=bearer(key))
    assert completions.status_code == 200
    handle = app.handles[MODEL]
    assert len(handle.calls) == 4 and handle.methods_made == 2  # chat's and completions', once each


def test_the_handle_transport_is_the_routers_setting_and_changes_in_place(router_app):
    """``router.handle_transport``: "grpc" calls the replica by value over Serve's gRPC, "actor"
    by reference as a Ray actor task; a change in place gets handles of its own. "direct" (the
    default) calls through the gRPC handle until a head names a line (test_direct_line.py)."""
    app = router_app()
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    handle = app.handles[MODEL]
    assert app.services.handle_transport == RouterArgs().handle_transport == "direct"
    for transport in ("direct", "grpc", "grpc", "actor", "grpc"):
        app.services.handle_transport = transport
        assert app.client.post("/v1/chat/completions", json=body, headers=bearer(key)).status_code == 200
    # One method handle a transport, by value then by reference; back on gRPC, its handle again.
    assert handle.options_made == [{"_by_reference": False}, {"_by_reference": True}]
    assert len(handle.calls) == 5 and handle.methods_made == 2
    with pytest.raises(ValueError):
        RouterArgs(handle_transport="http")


class ShapingFails(FakeEngine):
    """The engine generates the whole answer, then vLLM's serving layer refuses what it made (its
    Messages converter, a forced tool's arguments that are not an object: a 400 for the client's
    schema), or our own code fails on it (a 500, ``fault``)."""

    def __init__(self, *, fault: bool = False):
        super().__init__()
        self.fault = fault

    async def answer(self, surface, call):
        self.calls.append((surface, call))
        outputs = self.generate({"prompt_token_ids": [1] * 5}, FINAL_ONLY, call.request_id, max_tokens=3)
        _ = [output async for output in outputs]
        if self.fault:
            raise ValueError("a bug of ours")
        return Answer(400, error_body(400, "1 validation error for AnthropicContentBlock"))


@pytest.mark.parametrize("fault, status, billed", [(False, 400, (5, 3)), (True, 500, (0, 0))])
def test_an_answer_refused_after_the_engine_ran_is_billed_its_work_and_a_fault_of_ours_is_not(
        router_app, fault, status, billed):
    app = router_app(engine=ShapingFails(fault=fault))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    response = app.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert response.status_code == status
    (row,) = app.recorded()
    assert row["status"] == status and (row["prompt_tokens"], row["completion_tokens"]) == billed


def _requests_left(app, key) -> int:
    response = app.client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=bearer(key))
    return int(response.headers["x-ratelimit-remaining-requests"])


@pytest.mark.parametrize("body, status", [
    ({"input": "x", "previous_response_id": "resp_" + "0" * 32}, 404),  # a registry lookup, not found
    ({"input": "x", "max_tokens": 3}, 400),  # refused at pricing: a limit field the route ignores
])
def test_a_request_refused_at_its_stored_conversation_or_its_price_costs_one_request(router_app, body, status):
    # A slow tier, so that the remaining count is exact: the buckets refill continuously, and at
    # 600 requests a minute one comes back every 100 ms, which a loaded host spends between reads.
    app = router_app(engine=FakeEngine(), tiers={**TIERS, "small": Tier(requests_per_minute=10,
                                                                        tokens_per_minute=1_000_000)})
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")
    before = _requests_left(app, key)
    for _ in range(3):
        response = app.client.post("/v1/responses", json={"model": MODEL, **body}, headers=bearer(key))
        assert response.status_code == status
    assert _requests_left(app, key) == before - 4  # three refusals and this request
    invalid = app.client.post("/v1/responses", json={"model": MODEL, "input": 5}, headers=bearer(key))
    assert invalid.status_code == 400 and _requests_left(app, key) == before - 6  # validation too


@pytest.mark.parametrize("content, status", [
    (b'{"model": "qwen-3.6-35b-a3b", "messages": [', 400),  # parse: not JSON
    (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),  # resolve
    (json.dumps({"model": MODEL, "messages": 5}).encode(), 400),  # validate
    (json.dumps({"model": OTHER_MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(), 403),  # authorize
])
def test_a_key_sending_refused_requests_in_a_loop_meets_its_requests_per_minute(router_app, content, status):
    """Every refusal after the key is known is router work (a parse of up to the tier's minute of
    prompt): each costs one request, so a key looping on a bad body is refused before its body is
    read once its minute is spent, as any other key."""
    app = router_app(engine=FakeEngine())
    key, _ = app.auth.keys.create_key(owner="mallory", tier="tiny", models=(MODEL,))  # 2 requests a minute
    headers = {**bearer(key), "content-type": "application/json"}
    answers = [app.client.post("/v1/chat/completions", content=content, headers=headers) for _ in range(3)]
    assert [a.status_code for a in answers[:2]] == [status] * 2
    assert answers[2].status_code == 429 and answers[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert app.engine.calls == []


class MergedPrompts(FakeEngine):
    """As vLLM's completions serving layer with a ``prompt`` list: one final-only generation per
    prompt, merged; cancelled, it answers its own error and leaves each generation to be
    cancelled in the task vLLM's merge runs it in, after the request's task has ended."""

    async def answer(self, surface, call):
        from vllm.utils.async_utils import merge_async_iterators

        self.calls.append((surface, call))
        generations = [self.generate({"prompt_token_ids": [1] * 5}, FINAL_ONLY, f"{call.request_id}-{i}",
                                     max_tokens=1000) for i in range(2)]
        try:
            async for _ in merge_async_iterators(*generations):
                pass
        except asyncio.CancelledError:
            return Answer(400, error_body(400, "Client disconnected"))
        raise AssertionError("the client left before the end")


def test_a_non_stream_request_of_several_prompts_whose_client_leaves_is_billed_every_prompts_work(router_app):
    engine = MergedPrompts(latency_s=0.01)
    app = router_app(engine=engine)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "max_tokens": 1000, "prompt": ["a", "b"]}
    leave_once(app, surfaces.COMPLETIONS, body, key, lambda: engine.generated >= 10)
    (row,) = app.recorded()
    assert row["status"] == 499 and row["prompt_tokens"] == 10
    assert 10 <= row["completion_tokens"] == engine.generated < 2000


def test_a_refusal_whose_client_leaves_while_it_is_charged_is_still_settled(router_app, monkeypatch):
    app = router_app(engine=FakeEngine())
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    charging = []

    async def client_leaves_meanwhile(caller):
        charging.append(caller.key_id)
        raise asyncio.CancelledError  # Serve cancels the request's task while the limiter is asked

    monkeypatch.setattr(app.services.auth, "count_refused", client_leaves_meanwhile)
    settled = []
    settle = Context.settle
    monkeypatch.setattr(Context, "settle", lambda ctx, outcome: (settled.append(outcome.status), settle(ctx, outcome)))
    body = {"model": MODEL, "input": "x", "previous_response_id": "resp_" + "0" * 32}

    async def send():
        with pytest.raises(asyncio.CancelledError):
            await pipeline.run(app.services, _request(body, key, surfaces.RESPONSES.route), surfaces.RESPONSES)

    app.run(send)
    assert charging  # the refusal was being charged
    assert settled == [404]  # and the request was settled first (its telemetry closed), once


def test_a_client_that_leaves_while_its_stored_conversation_is_read_still_costs_one_request(router_app, monkeypatch):
    """Else leaving at once, request after request, would buy registry reads past the key's
    requests/min for nothing."""
    app = router_app(engine=FakeEngine())
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    before = _requests_left(app, key)

    async def client_leaves_meanwhile(body, caller):
        raise asyncio.CancelledError  # Serve cancels the request's task while the registry is read

    monkeypatch.setattr(app.services.responses, "continue_from", client_leaves_meanwhile)
    body = {"model": MODEL, "input": "x", "previous_response_id": "resp_" + "0" * 32}

    async def send():
        with pytest.raises(asyncio.CancelledError):
            await pipeline.run(app.services, _request(body, key, surfaces.RESPONSES.route), surfaces.RESPONSES)
        await wait_settled()  # the charge runs on its own task

    app.run(send)
    assert _requests_left(app, key) == before - 2  # the one that left, and this request


def test_waiting_for_settled_work_covers_work_that_work_started_meanwhile():
    """A background close can start another (a last item whose record needs a store write's):
    the router stops only once both are done, or the second's record is lost."""
    from serve_app.router.context import in_background

    done = []

    async def second():
        await asyncio.sleep(0.05)
        done.append("second")

    async def first():
        await asyncio.sleep(0.01)
        in_background(second())
        done.append("first")

    async def scenario():
        in_background(first())
        await wait_settled()
        return list(done)

    assert asyncio.run(scenario()) == ["first", "second"]


def test_a_client_that_hangs_up_while_its_body_is_read_still_costs_one_request(router_app):
    """Headers and part of a body, then gone (Starlette's ClientDisconnect): the read cost the
    router as a refusal's does, so it costs the key a request — else a loop of them is free."""
    app = router_app(engine=FakeEngine(), tiers={**TIERS, "small": Tier(requests_per_minute=10,
                                                                        tokens_per_minute=1_000_000)})
    key, _ = app.auth.keys.create_key(owner="alice", tier="small")
    before = _requests_left(app, key)
    headers = [(name.lower().encode(), value.encode()) for name, value in bearer(key).items()]
    headers += [(b"content-type", b"application/json"), (b"content-length", b"100000")]
    parts = [{"type": "http.request", "body": b'{"model": "', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return parts.pop(0)

    async def send():
        request = Request({"type": "http", "method": "POST", "path": surfaces.CHAT.route, "headers": headers,
                           "query_string": b""}, receive)
        response = await pipeline.run(app.services, request, surfaces.CHAT)
        await wait_settled()  # the charge runs on its own task
        return response.status_code

    assert app.run(send) == 499
    assert _requests_left(app, key) == before - 2  # the hang-up and this request
    assert [surface for surface, _ in app.engine.calls] == ["tokenize", "tokenize"]  # the two reads only


def test_a_refusal_carries_its_timing_and_its_trace_id(router_app):
    """A refused request's body has no pg_metadata: its trace id (the client's, when it sent a
    traceparent) and its timing, all network, come as headers, as on every JSON answer."""
    from serve_app.telemetry.request import TRACE_ID_HEADER
    from serve_app.telemetry.timing import parse_server_timing

    app = router_app(engine=FakeEngine())
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    unknown = app.client.post("/v1/chat/completions", json={"model": MODEL, "messages": []},
                              headers={**bearer("pgk_000000000000_wrong"), "traceparent": traceparent})
    assert unknown.status_code == 401 and unknown.headers[TRACE_ID_HEADER] == trace_id
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    missing = app.client.post("/v1/chat/completions", json={"model": "no-such-model", "messages": []},
                              headers=bearer(key))
    assert missing.status_code == 404 and len(missing.headers[TRACE_ID_HEADER]) == 32
    timing = parse_server_timing(missing.headers["server-timing"])
    assert set(timing) == {"network", "total"} and timing["network"] == timing["total"]
