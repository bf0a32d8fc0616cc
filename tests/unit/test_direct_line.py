"""The direct line (``wire/line.py``, ``router/lines.py``; ``router.handle_transport: direct``):
on the real router and the real ``ModelServer`` on fake engines (``router_app.py``), a call goes
on the replica's line once a head named it, answers exactly as through the handle and is billed
the same; every call the line does not start goes through the handle, and nothing is lost."""

import asyncio
import json
import socket
from types import SimpleNamespace

import pytest

from auth_support import MODEL, bearer
from fake_engine import FakeEngine
from router_app import InProcessHandle
from serve_app.config import ModelDeploymentArgs
from serve_app.engine.deployment import ModelServer
from serve_app.router import lines as router_lines
from serve_app.router.call import ReplicaCall
from serve_app.router.lines import Lines
from serve_app.routing import decisions
from serve_app.wire import handoff
from serve_app.wire import line as wire_line
from serve_app.wire.messages import Answer, Call, DirectLine, StreamOpen, Trailer
from serve_app.wire.socket import Listener

ASK = [{"role": "user", "content": "count"}]
STREAM_BODY = {"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": True}


@pytest.fixture(autouse=True)
def loopback(stream_loopback):
    yield
    decisions._pending.clear()  # what line calls made outside the pipeline published and none took


@pytest.fixture
def direct(router_app):
    app = router_app(engine=FakeEngine(tokens=4))
    app.services.handle_transport = "direct"
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    return app, key


def _chat(app, key, *, stream=True, headers=None):
    response = app.client.post(
        "/v1/chat/completions", headers={**bearer(key), **(headers or {})},
        json={"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": stream},
    )
    assert response.status_code == 200, response.text
    return response


def _choices(response) -> list:
    events = [e for e in response.text.split("\n\n") if e.startswith("data: {")]
    return [json.loads(e[6:]).get("choices") for e in events]


def _handle_calls(app) -> int:
    return len(app.handles[MODEL].calls)


def _server(app):
    return app.handles[MODEL].server


def test_once_a_head_named_the_line_calls_go_on_it_and_answer_and_bill_as_through_the_handle(direct):
    app, key = direct
    through_handle = _chat(app, key)
    assert _handle_calls(app) == 1 and app.services.lines.known(MODEL) == [_server(app).line]
    on_line = _chat(app, key)
    whole = _chat(app, key, stream=False)  # billed non-stream: Accepted, then the answer, on the line
    assert _handle_calls(app) == 1 and app.engine.count == 3
    assert _choices(on_line) == _choices(through_handle) and _choices(on_line)[1][0]["delta"]["content"] == "t1 "
    # The request's timing names how its replica was chosen: no routing decision, the only replica.
    assert '"routing"' not in through_handle.text  # the fake handle has no request router
    assert '"routing":{"policy":"direct_line","reason":"only_replica"}' in on_line.text
    assert whole.json()["choices"][0]["message"]["content"] == "t1 t2 t3 t4 "
    rows = app.recorded()
    assert [(row["status"], row["completion_tokens"]) for row in rows] == [(200, 4)] * 3
    assert _server(app).in_flight == 0


def test_with_two_replicas_every_call_goes_through_the_handle_whose_router_places_it(router_app):
    """Prefix affinity and session pins are Serve's request router's (routing/): worth more than
    the handle's milliseconds."""
    app = router_app(engine=FakeEngine(tokens=4), replicas=(FakeEngine(tokens=4),))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    assert app.services.handle_transport == "direct"
    for _ in range(3):
        _chat(app, key)
    assert _handle_calls(app) == 3 and len(app.services.lines.known(MODEL)) == 1  # named, not used


def test_while_a_replica_is_stopping_every_call_goes_through_the_handle(direct):
    """A redeploy: Serve knows which replica serves; the line known may be the stopping one's."""
    app, key = direct
    _chat(app, key)
    app.serve.replicas[f"model-{MODEL}"] = {"RUNNING": 1, "STOPPING": 1}
    app.run(app.services.states.refresh)
    _chat(app, key)
    assert _handle_calls(app) == 2
    app.serve.replicas[f"model-{MODEL}"] = {"RUNNING": 1}
    app.run(app.services.states.refresh)
    _chat(app, key)
    assert _handle_calls(app) == 2  # settled: on the line again


def test_a_line_no_head_named_for_a_while_is_dropped_and_learnt_again_through_the_handle(direct):
    app, key = direct
    now = [0.0]
    app.services.lines._clock = lambda: now[0]
    _chat(app, key)
    _chat(app, key)
    assert _handle_calls(app) == 1
    now[0] += router_lines.STALE_S + 1
    _chat(app, key)  # the line dropped (its replica may be gone): through the handle, which names it
    _chat(app, key)
    assert _handle_calls(app) == 2 and len(app.services.lines.known(MODEL)) == 1


def test_a_full_replica_refuses_and_the_call_goes_through_the_handle_keeping_the_line(direct):
    app, key = direct
    _chat(app, key)
    server = _server(app)
    server._args = server._args.model_copy(update={"max_ongoing_requests": 1})  # its deployment's, as it reads it
    server.in_flight += 1  # another router's call counted in flight: the replica is full to its lines
    _chat(app, key)
    server.in_flight -= 1
    assert _handle_calls(app) == 2 and len(app.services.lines.known(MODEL)) == 1
    assert [row["status"] for row in app.recorded()] == [200, 200]


def test_a_stopping_replica_refuses_names_no_line_and_is_forgotten(direct):
    app, key = direct
    _chat(app, key)
    _server(app).stopping = True
    _chat(app, key)  # refused on the line, served through the handle (here: the same fake replica)
    assert _handle_calls(app) == 2 and app.services.lines.known(MODEL) == []


def test_an_unreachable_line_is_forgotten_and_the_call_goes_through_the_handle(direct):
    app, key = direct
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        gone = ("127.0.0.1", probe.getsockname()[1])
    app.services.lines.learn(MODEL, DirectLine("gone", "0" * 32, gone))
    _chat(app, key)
    assert _handle_calls(app) == 1
    assert [line.replica for line in app.services.lines.known(MODEL)] == [_server(app).line.replica]
    assert [row["status"] for row in app.recorded()] == [200]


def test_an_engine_that_died_answers_503_on_the_line_and_its_line_is_forgotten(direct):
    app, key = direct
    _chat(app, key)
    app.engine.dead = True
    response = app.client.post("/v1/chat/completions", headers=bearer(key), json={**STREAM_BODY})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
    assert app.services.lines.known(MODEL) == []


# --- the wire, end to end between one router and one replica, without the pipeline ---------------
def _run(scenario):
    return asyncio.run(scenario())


@pytest.mark.parametrize("line", [b"f" * 32, "é".encode() * 16], ids=["another-key", "not-ascii"])
def test_a_connection_that_presents_another_key_is_closed_unread(line):
    served = []

    async def scenario():
        listener = Listener("127.0.0.1", on_line=lambda reader, writer: served.append(1))
        await listener.start()
        try:
            reader, writer = await asyncio.open_connection(*listener.address)
            writer.write(line + b"\n" + wire_line.frame(("chat", Call({}, "line-r"))))
            return await asyncio.wait_for(reader.read(), 5)
        finally:
            listener.close()

    assert _run(scenario) == b"" and served == []


def test_the_line_key_is_never_in_a_repr():
    line = DirectLine("r1", "k" * 32, ("127.0.0.1", 1))
    assert "k" * 32 not in repr(line) and "k" * 32 not in repr(StreamOpen(("h", 1), "t", line=line))


def test_a_call_sent_while_the_last_item_still_drains_is_read_whole():
    """The replica watches the line for a hang-up while it answers; once its last item is written
    the router may already send its next call, whose first byte the watch then holds."""
    async def scenario():
        reader, release, written, taken = asyncio.StreamReader(), asyncio.Event(), [], []

        class SlowWriter:  # the last item's drain waits until the next call is in
            def write(self, data):
                written.append(data)

            async def drain(self):
                await release.wait()

            def close(self):
                pass

        async def answer(call):
            yield Answer(200, {"id": call.request_id})

        def take(method, call):
            taken.append(call.request_id)
            return answer(call)

        reader.feed_data(wire_line.frame(("chat", Call({}, "line-one"))))
        serving = asyncio.ensure_future(wire_line.serve(reader, SlowWriter(), take))
        while len(written) < 2:  # READY, then the first answer: draining
            await asyncio.sleep(0.001)
        reader.feed_data(wire_line.frame(("chat", Call({}, "line-two"))))
        await asyncio.sleep(0.05)  # the watch reads the next call's first byte
        release.set()
        while len(taken) < 2 and not serving.done():
            await asyncio.sleep(0.001)
        reader.feed_eof()
        await asyncio.wait_for(serving, 5)
        return taken

    assert _run(scenario) == ["line-one", "line-two"]


def test_a_frame_half_read_when_the_client_left_is_read_whole_by_the_wait_for_the_last_item():
    """The usage in a call's last item is the bill: a cancelled wait must not cost its frame."""
    async def scenario():
        lines = Lines()
        lines.learn(MODEL, DirectLine("r1", "0" * 32, ("127.0.0.1", 1)))
        call = lines.call(MODEL, "chat", Call(dict(STREAM_BODY), "line-r"), replicas=1)
        reader = asyncio.StreamReader()
        call._connection = (reader, SimpleNamespace(is_closing=lambda: False, close=lambda: None))
        trailer = wire_line.frame(Trailer(usage={"completion_tokens": 7}, complete=False))
        reader.feed_data(trailer[:9])  # the length and a few bytes of the pickle
        waiting = asyncio.ensure_future(call.__anext__())
        await asyncio.sleep(0.01)
        waiting.cancel()  # the client left: the stream's wait is cancelled mid-frame
        await asyncio.gather(waiting, return_exceptions=True)
        reader.feed_data(trailer[9:])
        return await asyncio.wait_for(call.__anext__(), 5)

    assert _run(scenario).usage == {"completion_tokens": 7}


async def _replica_and_lines(engine: FakeEngine, **args):
    """The real replica on ``engine`` (``args``: its deployment's), and a router's lines that know its line."""
    cls = ModelServer.func_or_class
    server = object.__new__(cls)
    await cls.__init__(server, ModelDeploymentArgs(id=MODEL, **args), "/weights", make_engine=lambda a, p: engine)
    lines = Lines()
    lines.learn(MODEL, server.line)
    return server, lines


async def _stream_on_line(server, lines, call):
    replica_call = ReplicaCall(InProcessHandle(server).chat, call, MODEL, "local", surface="chat", lines=lines,
                                 replicas=1)
    head = await replica_call.first()
    assert isinstance(head, StreamOpen) and replica_call.by_line
    replica_call.present(None, keep=False, stall_s=0)
    data = b""
    while chunk := await replica_call.reader.read(65536):
        data += chunk
    return data, await replica_call.trailer()


@pytest.mark.parametrize("node", [None, "node-1"], ids=["across-nodes-tcp", "same-node-unix"])
def test_a_lines_connection_is_kept_for_the_next_call(monkeypatch, node):
    monkeypatch.setattr(handoff, "this_node", lambda: node)  # the replica's node, and the router's

    async def scenario():
        server, lines = await _replica_and_lines(FakeEngine(tokens=3))
        try:
            for n in range(2):
                data, trailer = await _stream_on_line(server, lines, Call(dict(STREAM_BODY), f"line-{n}"))
                # 3 + 2 events: the role, a token each, the finish.
                assert data.count(b"data: {") == 3 + 2 and isinstance(trailer, Trailer) and trailer.complete
            idle = lines._by_model[MODEL][server.line.key].idle
            family = idle[0][1].get_extra_info("socket").family
            return len(server._listener._lines), len(idle), family
        finally:
            lines.close()
            server.__del__()

    family = socket.AF_UNIX if node else socket.AF_INET
    assert _run(scenario) == (1, 1, family)  # one line connection served both calls, and waits for the next


def test_a_call_the_router_cancels_on_its_line_aborts_the_engine_request():
    engine = FakeEngine(tokens=1000, latency_s=0.005)

    async def scenario():
        server, lines = await _replica_and_lines(engine)
        try:
            replica_call = ReplicaCall(InProcessHandle(server).chat, Call({**STREAM_BODY, "max_tokens": 1000}, "line-r"),
                                       MODEL, "local", surface="chat", lines=lines, replicas=1)
            await replica_call.first()
            assert replica_call.by_line and server.in_flight == 1
            assert await server.record_autoscaling_stats() == {"line_calls": 1}  # no handle counts it
            replica_call.cancel()  # as the router gives up on a call: the line is closed
            for _ in range(500):
                if server.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            return server.in_flight
        finally:
            lines.close()
            server.__del__()

    assert _run(scenario) == 0 and engine.closed_early == 1 and engine.generated < 1000


def test_a_stopping_replica_finishes_what_its_lines_took_before_it_closes():
    engine = FakeEngine(tokens=40, latency_s=0.01)

    async def scenario():
        server, lines = await _replica_and_lines(engine)
        streaming = asyncio.ensure_future(_stream_on_line(server, lines, Call({**STREAM_BODY, "max_tokens": 40}, "line-r")))
        while server.in_flight == 0:
            await asyncio.sleep(0.005)
        stopping = asyncio.ensure_future(server.__del__())  # a wait: a call is under way
        await asyncio.sleep(0.05)
        refused = lines.call(MODEL, "chat", Call(dict(STREAM_BODY), "line-late"), replicas=1)
        try:
            await refused.__anext__()
            late = "taken"
        except router_lines.LineUnavailable as err:
            late = str(err)
        stopped_early = stopping.done()
        data, trailer = await streaming
        await stopping
        lines.close()
        return stopped_early, late, data.count(b"data: {"), trailer.complete

    stopped_early, late, events, complete = _run(scenario)
    assert not stopped_early and "stopping" in late
    assert events == 40 + 2 and complete and engine.stopped


def test_a_handle_call_that_finds_the_slots_taken_by_line_calls_waits_and_lines_refuse_meanwhile():
    """Serve admits handle calls by its own count, without the line calls: the replica's slots
    hold both kinds to max_ongoing_requests, so the engine never runs more, and once the replica
    is full Serve's count climbs to its limit and Serve queues and sheds as without lines."""
    engine = FakeEngine(tokens=30, latency_s=0.01)

    async def scenario():
        server, lines = await _replica_and_lines(engine, max_ongoing_requests=1)
        on_line = asyncio.ensure_future(_stream_on_line(server, lines, Call({**STREAM_BODY, "max_tokens": 30}, "line-a")))
        while engine.count == 0:
            await asyncio.sleep(0.005)
        by_handle = ReplicaCall(InProcessHandle(server).chat, Call(dict(STREAM_BODY), "line-b"), MODEL, "local")
        head = asyncio.ensure_future(by_handle.first())
        await asyncio.sleep(0.1)
        waited = not head.done() and engine.count == 1 and server.in_flight == 2
        assert lines.call(MODEL, "chat", Call(dict(STREAM_BODY), "line-c"), replicas=1) is None  # this router's own count
        other_router = Lines()
        other_router.learn(MODEL, server.line)
        try:
            await other_router.call(MODEL, "chat", Call(dict(STREAM_BODY), "line-c"), replicas=1).__anext__()
            third = "taken"
        except router_lines.LineUnavailable as err:
            third = str(err)
        await on_line
        await head  # the slot freed: the waiting handle call starts
        by_handle.present(None, keep=False, stall_s=0)
        while await by_handle.reader.read(65536):
            pass
        await by_handle.trailer()
        lines.close()
        other_router.close()
        server.__del__()
        return waited, third

    waited, third = _run(scenario)
    assert waited and "full" in third and engine.count == 2


def test_an_unreachable_line_has_the_tracker_read_serves_status_every_second(direct):
    app, key = direct
    with socket.socket() as probe:  # a port nothing listens on: the replica behind it is gone
        probe.bind(("127.0.0.1", 0))
        gone = ("127.0.0.1", probe.getsockname()[1])
    app.services.lines.learn(MODEL, DirectLine("gone", "0" * 32, gone))
    states = app.services.states
    app.run(states.refresh)
    assert not states._status_may_have_changed(states._wanted)  # steadily loaded: read every 10 s
    _chat(app, key)
    assert states._status_may_have_changed(states._wanted)  # suspect: read at every refresh


@pytest.mark.parametrize("assigned", [False, True], ids=["in-serves-queue", "taken-by-a-replica"])
def test_a_call_serves_queue_holds_fails_over_once_the_model_has_no_replica_here(tmp_path, router_app, monkeypatch,
                                                                                  assigned):
    """Serve's queue holds a call while the model has no running replica (its only one died) until
    a replacement starts, minutes on a GPU. Once the router's view says the model no longer serves
    here, the waiting call is given up (no replica had it) and the request fails over. A call a
    replica has taken (the view lags Serve's) waits for that replica's answer instead: here, its
    death (503 replica_unavailable), which fails over too."""
    import concurrent.futures
    import threading
    import time

    import httpx
    from ray.exceptions import RayActorError

    from auth_support import federated_regions
    from router_app import to_router
    from serve_app.config import Peer
    from serve_app.router import call as router_call

    monkeypatch.setattr(router_call, "SERVING_CHECK_S", 0.05)
    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=4))
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=FakeEngine(tokens=4),
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    home.services.handle_transport = "direct"
    queued, released = [], threading.Event()

    class Held:  # a handle call whose head does not come
        def __init__(self):
            self.cancelled = False
            self._replica_result_future = concurrent.futures.Future()  # Ray's: done once a replica has it
            if assigned:
                self._replica_result_future.set_result(object())

        async def __anext__(self):
            home.serve.stop(MODEL)  # its only replica died meanwhile; the tracker reads Serve's status
            await home.services.states.refresh()
            while not released.is_set():  # no replica: Serve would hold it until one is back
                await asyncio.sleep(0.01)
            raise RayActorError()  # the replica that had taken it died

        def cancel(self):
            self.cancelled = True

    class HeldInServesQueue:  # this region's handle of the model
        def options(self, **options):
            return self

        def __getattr__(self, method):
            return self

        def remote(self, call):
            queued.append(made := Held())
            return made

    own = home.services.handles[MODEL]
    home.services.handles[MODEL] = HeldInServesQueue()
    key, _ = home.auth.keys.create_key(owner="alice", tier="standard")
    answer = []
    request = threading.Thread(target=lambda: answer.append(_chat(home, key)), daemon=True)
    request.start()
    if assigned:
        time.sleep(0.5)  # ten looks at a model that no longer serves
        assert not answer and not queued[0].cancelled  # its replica has it: not given up
        released.set()
    request.join(10)
    released.set()
    home.services.handles[MODEL] = own  # the fixture's teardown stops its replicas
    assert answer, "the request waited in Serve's queue for a replica that is not coming"
    reason = "replica_unavailable" if assigned else "model_loading"
    assert answer[0].headers["x-pg-region"] == "yvr-01" and answer[0].headers["x-pg-failover-reason"] == reason
    assert [call.cancelled for call in queued] == [not assigned]  # given up in Serve's queue only
    assert [r["status"] for r in peer.recorded()] == [200] and home.recorded() == []
