"""Cross-region failover (serve_app/router/failover.py) against fake peers: an ``httpx.MockTransport``
answers for every peer (routed on host and path), and the relayed Starlette responses are played
through ASGI (``httpx.ASGITransport``) or read straight from their body iterator."""

import asyncio
import json
import logging
from types import SimpleNamespace

import httpx
import pytest

from serve_app.config import Peer
from serve_app.router import failover
from serve_app.router.failover import (
    FAILOVER_FROM_HEADER,
    FAILOVER_REASON_HEADER,
    HOP_HEADER,
    REGION_HEADER,
    Forwarder,
)
from serve_app.surfaces import dialects
from tests.schema_validation import validate_responses

ROUTE = "/v1/chat/completions"
BODY = {"model": "qwen-3.6-35b-a3b", "messages": [{"role": "user", "content": "héllo"}], "max_tokens": 8}
AUTH = {"authorization": "Bearer sk-secret-credential", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
PEERS = [Peer(region="yvr-01", endpoint="https://yvr.test"), Peer(region="yyz-01", endpoint="https://yyz.test"), Peer(region="ams-01", endpoint="https://ams.test")]


class Peers:
    """Fake peer routers: ``answers[host]`` is a response, an exception to raise, or a callable."""

    def __init__(self, **answers):
        self.answers = {f"{host}.test": answer for host, answer in answers.items()}
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.get(request.url.host, httpx.Response(404))
        if isinstance(answer, Exception):
            raise answer
        return answer(request) if callable(answer) else answer

    def hosts(self) -> list[str]:
        return [r.url.host for r in self.requests]


def forwarder(peers: Peers, peer_list=PEERS, **kwargs) -> Forwarder:
    return Forwarder("yul-02", peer_list, transport=httpx.MockTransport(peers), **kwargs)


def forward(fwd: Forwarder, body=BODY, *, reason="overloaded", **kwargs):
    async def go():
        try:
            return await fwd.forward(ROUTE, body, AUTH, reason=reason, **kwargs)
        finally:
            await fwd.aclose()

    return asyncio.run(go())


async def play(response) -> httpx.Response:
    """What a client would receive: the response served over ASGI."""

    async def app(scope, receive, send):
        await response(scope, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://client") as client:
        return await client.get("/")


def unavailable() -> httpx.Response:
    return httpx.Response(503, json={"error": {"code": "overloaded"}}, headers={"retry-after": "2"})


def sse(events: list[bytes]):
    async def chunks():
        for event in events:
            yield event

    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())


def test_request_goes_to_endpoint_plus_route_with_hop_header_credential_and_body():
    peers = Peers(yvr=httpx.Response(200, json={"ok": True}))
    fwd = Forwarder("yul-02", [Peer(region="yvr-01", endpoint="https://yvr.test/")], transport=httpx.MockTransport(peers))
    forward(fwd)
    (request,) = peers.requests
    assert request.method == "POST" and str(request.url) == "https://yvr.test/v1/chat/completions"
    assert request.headers[HOP_HEADER] == "yul-02"
    assert request.headers["authorization"] == AUTH["authorization"]
    assert request.headers["traceparent"] == AUTH["traceparent"]
    assert request.headers["content-type"] == "application/json"
    assert request.headers["accept-encoding"] == "identity"
    assert json.loads(request.content) == BODY


def test_stale_transport_headers_from_the_caller_are_not_forwarded():
    peers = Peers(yvr=httpx.Response(200, json={}))
    fwd = forwarder(peers)
    asyncio.run(fwd.forward(ROUTE, BODY, {**AUTH, "Content-Length": "3", "Host": "api.yul", "Accept": "x/y"},
                            reason="overloaded"))
    (request,) = peers.requests
    assert request.headers["content-length"] == str(len(request.content))
    assert request.headers["host"] == "yvr.test"
    assert request.headers.get_list("accept") == ["application/json"]


def test_endpoint_with_a_path_prefix_keeps_it():
    seen = []
    fwd = Forwarder("yul-02", [Peer(region="local-peer", endpoint="http://127.0.0.1:8123/peer")],
                    transport=httpx.MockTransport(lambda r: seen.append(r) or httpx.Response(200, json={})))
    result = forward(fwd)
    assert result is not None and result.region == "local-peer"
    assert seen[0].url.host == "127.0.0.1" and seen[0].url.port == 8123
    assert seen[0].url.path == "/peer/v1/chat/completions"


def test_json_answer_is_relayed_with_status_body_and_headers():
    answer = httpx.Response(
        200,
        json={"id": "chatcmpl-1", "choices": []},
        headers={
            "server-timing": "engine;dur=12.5",
            "x-ratelimit-remaining-requests": "99",
            "x-ratelimit-limit-tokens": "1000000",
            "x-budget-remaining-tokens-day": "5000",  # docs/usage.md: every answer to a key with a budget
            "x-pg-trace-id": "4bf92f3577b34da6a3ce929d0e0e4736",  # the one trace, continued there
            "retry-after": "1",
            "x-internal-secret": "nope",
            "connection": "keep-alive",
        },
    )
    done = []
    result = forward(forwarder(Peers(yvr=answer)), on_done=lambda *a: done.append(a))
    assert result.region == "yvr-01" and result.status == 200
    assert [(a.region, a.outcome, a.status) for a in result.attempts] == [("yvr-01", "served", 200)]
    assert done == [] and not result.stream  # a JSON answer is complete when returned
    got = asyncio.run(play(result.response))
    assert got.status_code == 200 and got.json() == {"id": "chatcmpl-1", "choices": []}
    assert got.headers["content-type"] == "application/json"
    assert got.headers[REGION_HEADER] == "yvr-01"  # the peer set none: the serving peer's region
    assert got.headers[FAILOVER_FROM_HEADER] == "yul-02"
    assert got.headers[FAILOVER_REASON_HEADER] == "overloaded"
    assert got.headers["server-timing"] == "engine;dur=12.5"
    assert got.headers["x-ratelimit-remaining-requests"] == "99"
    assert got.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert got.headers["x-budget-remaining-tokens-day"] == "5000"
    assert got.headers["x-pg-trace-id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert got.headers["retry-after"] == "1"
    assert "x-internal-secret" not in got.headers and "connection" not in got.headers
    assert got.headers.get_list("content-length") == [str(len(got.content))]
    assert [k for k, _ in result.response.raw_headers].count(b"content-length") == 1


def test_peer_region_header_wins_over_the_configured_name():
    answer = httpx.Response(200, json={}, headers={REGION_HEADER: "yvr-01b"})
    result = forward(forwarder(Peers(yvr=answer)))
    assert result.response.headers.getlist(REGION_HEADER) == ["yvr-01b"]


def test_first_peer_503_then_second_serves_and_attempts_are_recorded():
    peers = Peers(yvr=unavailable(), yyz=httpx.Response(200, json={"from": "yyz"}))
    result = forward(forwarder(peers), reason="model_loading")
    assert peers.hosts() == ["yvr.test", "yyz.test"]
    assert result.region == "yyz-01" and result.status == 200
    assert [(a.region, a.outcome, a.status) for a in result.attempts] == [
        ("yvr-01", "unavailable", 503),
        ("yyz-01", "served", 200),
    ]
    assert all(a.duration_ms >= 0 for a in result.attempts)
    got = asyncio.run(play(result.response))
    assert got.json() == {"from": "yyz"} and got.headers[FAILOVER_REASON_HEADER] == "model_loading"


@pytest.mark.parametrize(
    "failure, outcome",
    [
        (httpx.ConnectError("connection refused"), "connect_error"),
        (httpx.ConnectTimeout("connect timed out"), "timeout"),
        (httpx.WriteTimeout("request not sent"), "timeout"),  # a ReadTimeout stays with its peer (below)
        (httpx.WriteError("connection reset while sending"), "error"),  # the peer never had all of it
        # A pooled connection the peer's proxy had closed, broken at once: the request ran nowhere.
        (httpx.RemoteProtocolError("Server disconnected without sending a response."), "error"),
        (httpx.ReadError("connection reset by peer"), "error"),
        (httpx.PoolTimeout("this router's pool is full"), "error"),  # ours, not the peer's: not held back
    ],
)
def test_network_failures_move_on_to_the_next_peer(failure, outcome):
    peers = Peers(yvr=failure, yyz=httpx.Response(200, json={}))
    result = forward(forwarder(peers))
    assert [(a.region, a.outcome, a.status) for a in result.attempts] == [
        ("yvr-01", outcome, None),
        ("yyz-01", "served", 200),
    ]


def test_all_peers_failing_returns_no_response_and_logs_without_credentials():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    try:
        peers = Peers(yvr=unavailable(), yyz=httpx.ConnectError("refused"))
        result = forward(forwarder(peers))
        assert result.response is None and result.region is None
        assert [(a.region, a.outcome, a.status) for a in result.attempts] == [
            ("yvr-01", "unavailable", 503), ("yyz-01", "connect_error", None)
        ]
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(messages) == 2 and "yvr-01" in messages[0] and "unavailable" in messages[0]
    assert "yyz-01" in messages[1] and "connect_error" in messages[1]
    assert not any("sk-secret" in m or "héllo" in m for m in messages)


def test_an_unreachable_peer_is_skipped_for_a_while_then_tried_again():
    now = [100.0]
    peers = Peers(yvr=httpx.ConnectError("refused"), yyz=httpx.Response(200, json={}))
    fwd = Forwarder("yul-02", PEERS, transport=httpx.MockTransport(peers), clock=lambda: now[0])
    assert forward(fwd).region == "yyz-01"
    assert peers.hosts() == ["yvr.test", "yyz.test"]

    now[0] += 5  # within the hold: no connect attempt, and it does not use up an attempt
    peers.requests.clear()
    result = forward(fwd)
    assert peers.hosts() == ["yyz.test"] and result.region == "yyz-01"
    assert [(a.region, a.outcome) for a in result.attempts] == [("yvr-01", "skipped"), ("yyz-01", "served")]

    now[0] += 10  # the hold is over: tried again
    peers.requests.clear()
    peers.answers["yvr.test"] = httpx.Response(200, json={})
    assert forward(fwd).region == "yvr-01"


def test_waiting_for_this_routers_own_pool_does_not_hold_a_peer_back():
    now = [100.0]
    peers = Peers(yvr=httpx.PoolTimeout("no free connection"), yyz=httpx.Response(200, json={}))
    fwd = Forwarder("yul-02", PEERS, transport=httpx.MockTransport(peers), clock=lambda: now[0])
    assert forward(fwd).region == "yyz-01"
    peers.answers["yvr.test"] = httpx.Response(200, json={})
    assert forward(fwd).region == "yvr-01"  # tried again at once


def test_more_streams_forwarded_at_once_than_httpxs_default_pool_all_reach_the_peer():
    """httpx caps a client at 100 connections: the 101st forwarded stream waited for the pool,
    timed out, and the peer was held back as unreachable. The router's admission bounds it."""
    async def scenario():
        async def hold(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            await writer.drain()
            await reader.read()  # the stream stays open until the router closes it

        server = await asyncio.start_server(hold, "127.0.0.1", 0, backlog=256)
        port = server.sockets[0].getsockname()[1]
        fwd = Forwarder("yul-02", [Peer(region="yvr-01", endpoint=f"http://127.0.0.1:{port}")], connect_timeout_s=0.5)
        opened = await asyncio.gather(*(fwd.open(ROUTE, {**BODY, "stream": True}, AUTH) for _ in range(105)))
        assert [attempts[0].outcome for _, _, attempts in opened] == ["served"] * 105
        for _, upstream, _ in opened:
            await upstream.aclose()
        await fwd.aclose()
        server.close()

    asyncio.run(scenario())


def test_a_peer_given_a_new_endpoint_is_tried_at_once_not_held_back_for_the_old_ones_failures():
    now = [100.0]
    peers = Peers(yvr=httpx.ConnectError("refused"), yyz=httpx.Response(200, json={}))
    fwd = Forwarder("yul-02", PEERS, transport=httpx.MockTransport(peers), clock=lambda: now[0])
    assert forward(fwd).region == "yyz-01"  # yvr-01 is held back now
    moved = [Peer(region="yvr-01", endpoint="https://yvr-new.test"), *PEERS[1:]]
    fwd.apply(moved, connect_timeout_s=2, read_timeout_s=600, max_attempts=2, unreachable_hold_s=10)
    peers.answers["yvr-new.test"] = httpx.Response(200, json={})
    assert forward(fwd).region == "yvr-01"
    fwd.apply(moved, connect_timeout_s=2, read_timeout_s=600, max_attempts=2, unreachable_hold_s=10)
    assert fwd._unreachable_until == {}  # nothing held, nothing to drop


def test_a_failure_of_an_endpoint_replaced_meanwhile_holds_nothing_back():
    now = [100.0]
    moved = [Peer(region="yvr-01", endpoint="https://yvr-new.test"), *PEERS[1:]]

    def old_endpoint_fails_after_the_change(request):
        fwd.apply(moved, connect_timeout_s=2, read_timeout_s=600, max_attempts=2, unreachable_hold_s=10)
        raise httpx.ConnectError("refused")

    peers = Peers(yvr=old_endpoint_fails_after_the_change, yyz=httpx.Response(200, json={}))
    fwd = Forwarder("yul-02", PEERS, transport=httpx.MockTransport(peers), clock=lambda: now[0])
    assert forward(fwd).region == "yyz-01"
    assert "yvr-01" not in fwd._unreachable_until  # the new endpoint is not held back for the old one


def test_a_peer_answering_503_is_not_held_back():
    now = [100.0]
    peers = Peers(yvr=unavailable(), yyz=httpx.Response(200, json={}))
    fwd = Forwarder("yul-02", PEERS, transport=httpx.MockTransport(peers), clock=lambda: now[0])
    forward(fwd)
    peers.requests.clear()
    forward(fwd)
    assert peers.hosts() == ["yvr.test", "yyz.test"]  # busy is not down: ask it again


def test_allowed_skips_peers_and_skipped_peers_do_not_count_as_attempts():
    peers = Peers(yvr=httpx.Response(200, json={}), yyz=unavailable(), ams=httpx.Response(200, json={}))
    result = forward(forwarder(peers), allowed=lambda region: region != "yvr-01")
    assert peers.hosts() == ["yyz.test", "ams.test"]
    assert result.region == "ams-01"


def test_nothing_allowed_returns_no_response_without_any_request():
    peers = Peers(yvr=httpx.Response(200, json={}))
    result = forward(forwarder(peers), allowed=lambda region: False)
    assert result.response is None and result.attempts == []
    assert peers.requests == []


def test_max_attempts_is_respected():
    peers = Peers(yvr=unavailable(), yyz=unavailable(), ams=httpx.Response(200, json={}))
    assert forward(forwarder(peers)).response is None  # default: two attempts
    assert peers.hosts() == ["yvr.test", "yyz.test"]
    peers = Peers(yvr=unavailable(), yyz=unavailable(), ams=httpx.Response(200, json={}))
    assert forward(forwarder(peers, max_attempts=3)).region == "ams-01"


def test_a_peer_named_like_the_local_region_is_never_tried():
    peers = Peers(yvr=httpx.Response(200, json={}), yyz=httpx.Response(200, json={}))
    result = forward(forwarder(peers, [Peer(region="yul-02", endpoint="https://yvr.test"), Peer(region="yyz-01", endpoint="https://yyz.test")]))
    assert peers.hosts() == ["yyz.test"] and result.region == "yyz-01"


def test_peers_may_be_any_object_with_region_and_endpoint():
    peers = Peers(yvr=httpx.Response(200, json={}))
    result = forward(forwarder(peers, [SimpleNamespace(region="yvr-01", endpoint="https://yvr.test")]))
    assert result.region == "yvr-01"


@pytest.mark.parametrize(
    "status, headers",
    [
        (400, {}),
        (401, {"www-authenticate": 'Bearer error="invalid_token"'}),
        (429, {"retry-after": "7", "x-ratelimit-reset-requests": "7s"}),
    ],
)
def test_peer_errors_other_than_503_are_relayed_not_retried(status, headers):
    error = {"error": {"message": "no", "type": "x", "param": None, "code": None}}
    peers = Peers(yvr=httpx.Response(status, json=error, headers=headers), yyz=httpx.Response(200, json={}))
    done = []
    result = forward(forwarder(peers), on_done=lambda *a: done.append(a))
    assert peers.hosts() == ["yvr.test"]
    assert result.status == status and result.attempts[0].outcome == "served"
    assert done == [] and result.error_type is None
    got = asyncio.run(play(result.response))
    assert got.status_code == status and got.json() == error
    for key, value in headers.items():
        assert got.headers[key] == value


def test_sse_stream_is_relayed_chunk_by_chunk_and_on_done_fires_once():
    first = b'data: {"id": "c1", "choices": [{"delta": {"content": "Hi"}}]}\n\n'
    rest = [b'data: {"id": "c1", "choices": [{"delta": {"content": "!"}}]}\n\n', b"data: [DONE]\n\n"]
    released = asyncio.Event()

    async def chunks():
        yield first
        await released.wait()  # the rest only once the client has the first chunk: no buffering
        for chunk in rest:
            yield chunk

    answer = httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=chunks())
    done = []

    async def go():
        fwd = forwarder(Peers(yvr=answer))
        result = await fwd.forward(ROUTE, {**BODY, "stream": True}, AUTH, reason="cold",
                                   on_done=lambda *a: done.append(a))
        assert result.response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert result.response.headers[FAILOVER_REASON_HEADER] == "cold"
        assert "content-length" not in result.response.headers
        body = result.response.body_iterator
        got = [await asyncio.wait_for(body.__anext__(), 2)]
        assert done == []  # not done while the stream is still open
        released.set()
        got += [chunk async for chunk in body]
        await fwd.aclose()
        return got

    assert asyncio.run(go()) == [first, *rest]
    assert done == [(200, None)]


def test_stream_request_asks_for_event_stream():
    peers = Peers(yvr=sse([b"data: [DONE]\n\n"]))
    result = forward(forwarder(peers), {**BODY, "stream": True})
    assert peers.requests[0].headers["accept"] == "text/event-stream"
    got = asyncio.run(play(result.response))
    assert got.content == b"data: [DONE]\n\n"


def test_stream_breaking_midway_ends_with_an_error_event_and_done():
    async def chunks():
        yield b'data: {"id": "c1"}\n\n'
        raise httpx.ReadError("peer reset the connection")

    answer = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())
    done = []

    async def go():
        fwd = forwarder(Peers(yvr=answer))
        result = await fwd.forward(ROUTE, {**BODY, "stream": True}, AUTH, reason="overloaded",
                                   on_done=lambda *a: done.append(a))
        got = await play(result.response)
        await fwd.aclose()
        return got

    got = asyncio.run(go())
    assert got.status_code == 200  # the head was sent before the break
    events = [e for e in got.text.split("\n\n") if e]
    assert events[0] == 'data: {"id": "c1"}'
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "peer_stream_failed" and error["param"] is None
    assert events[2] == "data: [DONE]"
    assert done == [(502, "peer_stream_failed")]


def test_a_responses_stream_breaking_midway_ends_with_an_error_event_that_continues_its_numbering():
    """The peer's events are numbered; the error event that ends the broken stream is the next
    number, in both specs' shapes (OpenAI's fields and Open Responses' ``error`` object)."""
    sent = [f'event: response.output_text.delta\ndata: {{"type":"response.output_text.delta","sequence_number":{n}}}\n\n'
            for n in range(12)]

    async def chunks():
        payload = "".join(sent).encode()
        for start in range(0, len(payload), 50):  # reads that cut the numbers apart
            yield payload[start:start + 50]
        raise httpx.ReadError("peer reset the connection")

    answer = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    async def go():
        fwd = forwarder(Peers(yvr=answer))
        result = await fwd.forward("/v1/responses", {"model": BODY["model"], "input": "hi", "stream": True}, AUTH,
                                   reason="overloaded", on_done=lambda *a: None, dialect=dialects.RESPONSES)
        got = await play(result.response)
        await fwd.aclose()
        return got

    got = asyncio.run(go())
    frames = [frame for frame in got.text.split("\n\n") if frame]
    assert len(frames) == 13 and frames[-1].startswith("event: error\n")
    error = json.loads(frames[-1].split("data: ", 1)[1])
    assert error["sequence_number"] == 12 and error["code"] == error["error"]["code"] == "peer_stream_failed"
    validate_responses(error, event=True)
    assert "[DONE]" not in got.text


class PeerStream(httpx.AsyncByteStream):
    """A peer still generating: one event, then nothing until closed. Its close awaits, like a real
    connection's, so a close that is not shielded from the client's cancellation never finishes."""

    def __init__(self):
        self.closed = False

    async def __aiter__(self):
        yield b'data: {"id": "c1"}\n\n'
        await asyncio.Event().wait()

    async def aclose(self):
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.closed = True


@pytest.mark.parametrize("client_blocks", [False, True], ids=["peer-generating", "client-send-blocked"])
def test_client_leaving_mid_stream_closes_the_peer_and_reports_499(client_blocks):
    """Served over ASGI 2.3 (the client's disconnect cancels the relay). The cancellation lands
    either inside the peer read or, when the client's socket is slow, inside ``send``."""
    peer = PeerStream()

    async def go():
        done, sent, got_body = [], [], asyncio.Event()
        answer = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=peer)
        fwd = forwarder(Peers(yvr=answer))
        result = await fwd.forward(ROUTE, {**BODY, "stream": True}, AUTH, reason="overloaded",
                                   on_done=lambda *a: done.append(a))

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body":
                got_body.set()
                if client_blocks:
                    await asyncio.Event().wait()

        async def receive():
            await got_body.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "GET", "path": "/"}
        await asyncio.wait_for(result.response(scope, receive, send), 2)
        # Checked here, at once: asyncio.run would finalize an abandoned generator on its way out.
        closed_at_once = peer.closed
        await fwd.aclose()
        return done, sent, closed_at_once

    done, sent, closed_at_once = asyncio.run(go())
    assert done == [(499, "client_closed")]
    assert closed_at_once
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b'data: {"id": "c1"}\n\n']


def test_non_stream_body_breaking_becomes_a_502_error():
    async def chunks():
        yield b'{"id": '
        raise httpx.ReadError("peer reset the connection")

    answer = httpx.Response(200, headers={"content-type": "application/json"}, content=chunks())
    done = []
    result = forward(forwarder(Peers(yvr=answer)), on_done=lambda *a: done.append(a))
    assert result.status == 502 and result.attempts[0].outcome == "error"
    assert result.error_type == "peer_stream_failed" and done == []
    got = asyncio.run(play(result.response))
    assert got.status_code == 502 and got.json()["error"]["code"] == "peer_stream_failed"
    assert got.headers[FAILOVER_FROM_HEADER] == "yul-02"


def test_aclose_before_use_and_twice_is_safe():
    async def go():
        fwd = forwarder(Peers())
        await fwd.aclose()
        result = await fwd.forward(ROUTE, BODY, AUTH, reason="overloaded")  # works after a close
        await fwd.aclose()
        await fwd.aclose()
        return result

    result = asyncio.run(go())
    # A close only drops the connection pool: the next forward opens a new one and is served.
    assert [a.outcome for a in result.attempts] == ["served"] and result.response is not None


def test_a_messages_body_breaking_is_an_anthropic_shaped_502():
    """The request's own dialect, as every other error on Anthropic's routes."""
    async def chunks():
        yield b'{"id": '
        raise httpx.ReadError("peer reset the connection")

    answer = httpx.Response(200, headers={"content-type": "application/json"}, content=chunks())
    result = forward(forwarder(Peers(yvr=answer)), dialect=dialects.ANTHROPIC)
    got = asyncio.run(play(result.response))
    assert got.status_code == 502 and got.json()["type"] == "error"
    assert got.json()["error"]["type"] == "api_error" and "yvr" in got.json()["error"]["message"]


@pytest.mark.parametrize("send_suspends", [True, False])
def test_a_relayed_stream_whose_client_left_before_its_body_settles_and_closes_the_peer(send_suspends):
    """A client gone while the router waited for the peer's head: Starlette cancels the response at
    its first suspension, before the body's generator ever started, whose close then runs none of
    its code. The request must still settle (on_done: the charge refunded, the trace ended) and
    the peer's connection close (else the peer generates on, billing, until its stall cut)."""
    peer = PeerStream()

    async def scenario():
        answer = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=peer)
        fwd = Forwarder("yul-02", [Peer(region="yvr-01", endpoint="https://yvr.test")],
                        transport=httpx.MockTransport(lambda request: answer))
        done = []
        result = await fwd.forward("/v1/chat/completions", {"model": "m", "stream": True}, {},
                                   reason="overloaded", on_done=lambda *ended: done.append(ended))

        async def send(message):  # a real ASGI chain suspends somewhere (a middleware, a drain)
            if send_suspends:
                await asyncio.sleep(0)

        async def receive():  # the client hung up while the peer was being asked
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/"}
        await asyncio.wait_for(result.response(scope, receive, send), 2)
        return done

    assert asyncio.run(scenario()) == [(499, "client_closed")]  # once, however the response ended
    assert peer.closed


@pytest.mark.parametrize("broke, connection", [
    (httpx.ReadTimeout("no head within the read timeout"), "pooled"),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."), "new"),  # a proxy's cut
    (httpx.ReadError("connection reset by peer"), "new"),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."), "pooled, broke late"),
    (httpx.ReadError("connection reset by peer"), "new, through a SOCKS proxy"),
])
def test_a_peer_that_had_the_request_and_sent_no_head_is_not_followed_by_another(broke, connection, monkeypatch):
    """Sent, then no head: none within the read timeout, or the line broke on a connection of its
    own or later than a stale pooled one breaks. The peer may be running (and billing) it; a
    second peer would run it again and bill it twice: the local 503 answers instead."""
    sent_to = []
    if connection == "pooled, broke late":
        monkeypatch.setattr(failover, "STALE_BREAK_S", 0.0)

    async def peers(request: httpx.Request) -> httpx.Response:
        sent_to.append(request.url.host)
        if connection.startswith("new"):  # what httpcore tells the request's trace when it opens one
            prefix = "socks" if "SOCKS" in connection else "connection"
            await request.extensions["trace"](f"{prefix}.connect_tcp.complete", {})
        if request.url.host == "yvr.test":
            broke.request = request
            raise broke
        return httpx.Response(200, json={"ok": True})

    regions = [Peer(region="yvr-01", endpoint="https://yvr.test"), Peer(region="fra-01", endpoint="https://fra.test")]
    fwd = Forwarder("yul-02", regions, transport=httpx.MockTransport(peers))

    async def go():
        result = await fwd.forward("/v1/chat/completions", {"model": "m", "messages": []}, {}, reason="overloaded")
        await fwd.aclose()
        return result

    result = asyncio.run(go())
    assert sent_to == ["yvr.test"] and result.response is None
    assert [(a.region, a.outcome) for a in result.attempts] == [("yvr-01", "no_head")]
    assert fwd._unreachable_until == {}  # slow, not unreachable: the next request tries it again


def test_on_real_sockets_a_new_connection_that_breaks_stays_a_stale_pooled_one_moves_on():
    """httpcore's trace says whether the request opened its own connection. yvr answers its first
    request (keep-alive) and then closes every connection as soon as a request arrives on it: the
    next request, on the pooled connection, ran nowhere and goes to fra; a request on a new
    connection that breaks the same way stays with yvr (no_head)."""
    async def scenario():
        got: dict[str, int] = {"yvr": 0, "fra": 0}

        def server(name: str, answers_first: bool):
            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    while True:
                        head = await reader.readuntil(b"\r\n\r\n")
                        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                          if line.lower().startswith(b"content-length")))
                        await reader.readexactly(length)
                        got[name] += 1
                        if name == "yvr" and not (answers_first and got[name] == 1):
                            break  # the request reached it; the line breaks before any head
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: 2\r\n\r\n{}")
                        await writer.drain()
                finally:
                    writer.close()
            return handle

        yvr = await asyncio.start_server(server("yvr", answers_first=True), "127.0.0.1", 0)
        fra = await asyncio.start_server(server("fra", answers_first=False), "127.0.0.1", 0)
        peers = [Peer(region="yvr-01", endpoint=f"http://127.0.0.1:{yvr.sockets[0].getsockname()[1]}"),
                 Peer(region="fra-01", endpoint=f"http://127.0.0.1:{fra.sockets[0].getsockname()[1]}")]
        fwd = Forwarder("yul-02", peers)
        body = {"model": "m", "messages": []}
        first = await fwd.forward(ROUTE, body, {}, reason="overloaded")  # answered, read: its connection pooled
        second = await fwd.forward(ROUTE, body, {}, reason="overloaded")  # the pooled connection breaks
        outcomes = [[(a.region, a.outcome) for a in result.attempts] for result in (first, second)]
        await fwd.aclose()
        fresh_fwd = Forwarder("yul-02", peers)
        third = await fresh_fwd.forward(ROUTE, body, {}, reason="overloaded")  # a new connection breaks
        outcomes.append([(a.region, a.outcome) for a in third.attempts])
        await fresh_fwd.aclose()
        yvr.close()
        fra.close()
        return outcomes, got

    outcomes, got = asyncio.run(scenario())
    assert outcomes == [[("yvr-01", "served")], [("yvr-01", "error"), ("fra-01", "served")], [("yvr-01", "no_head")]]
    assert got == {"yvr": 3, "fra": 1}
