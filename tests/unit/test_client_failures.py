"""serve_app.client when things go wrong across regions and connections (a user's review): the
error raised is the most useful of the call's, a region that does not serve the model or cannot be
reached does not spend the retries a live region asked to wait for, a pooled connection the
server closed is sent again, a stream closed by another task never looks complete, and errors
carry the request id, headers and body, and pickle."""

import asyncio
import pickle

import httpx
import pytest

from serve_app.client import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    NotFoundError,
    RateLimitError,
    ServeAppError,
    ServiceUnavailableError,
)
from serve_app.client.errors import from_response, retry_after_s
from tests.unit.client_fake_server import FakeRegion, dead_url, error, streaming, unavailable
from tests.unit.client_fake_server import run_client
from tests.unit.test_client_retries import REQUEST, run


def not_served() -> object:
    return error(404, "The model 'qwen-3.6-35b-a3b' does not exist", type_="invalid_request_error",
                 code="model_not_found", param="model")


def test_a_region_that_does_not_serve_the_model_does_not_hide_another_regions_503():
    """A's 503 said when to come back; B does not serve the model. The caller got B's 404 "does
    not exist", which no client retries."""
    a, b = FakeRegion("yul-02"), FakeRegion("yvr-01")
    a.answers += [unavailable(retry_after="60")] * 3
    b.answers += [not_served()] * 3

    async def scenario(client):
        with pytest.raises(ServiceUnavailableError) as err:
            await client.chat_completion(REQUEST)
        return err.value

    err = run([a, b], scenario, max_retry_time_s=5)
    assert (err.status, err.retry_after, err.region) == (503, 60.0, "yul-02")
    assert a.statuses == [503] and b.statuses == [404]


def test_a_first_region_that_does_not_serve_the_model_moves_on_to_one_that_does():
    b, a = FakeRegion("yvr-01"), FakeRegion("yul-02")
    b.answers.append(not_served())
    reply = run([b, a], lambda client: client.chat_completion(REQUEST))
    assert reply.timing.region == "yul-02" and b.statuses == [404] and a.statuses == [200]


def test_a_model_no_region_serves_is_a_404_once_each_and_one_region_alone_is_asked_once():
    a, b = FakeRegion("yul-02"), FakeRegion("yvr-01")
    a.answers.append(not_served())
    b.answers.append(not_served())

    async def scenario(client):
        with pytest.raises(NotFoundError) as err:
            await client.chat_completion(REQUEST)
        return err.value

    assert run([a, b], scenario).region == "yul-02"  # the caller's first region's word
    assert a.statuses == [404] and b.statuses == [404]
    alone = FakeRegion("yul-02")
    alone.answers += [not_served()] * 2
    run([alone], scenario)
    assert alone.statuses == [404]


def test_an_unreachable_region_does_not_spend_the_retries_a_live_region_asked_to_wait_for():
    """The dead region's backoff (≤ 0.5 s, then ≤ 1 s) came before the live region's Retry-After
    (2 s): every retry went to the dead one, and the caller got its connection error."""
    live = FakeRegion("yul-02")
    live.answers.append(unavailable(retry_after="2"))
    reply = run([live], lambda client: client.chat_completion(REQUEST), extra_urls=[dead_url()], max_retries=2)
    assert reply.timing.region == "yul-02" and live.statuses == [503, 200]


def _mock_client(handler, hosts=("mock",), **options) -> AsyncClient:
    return AsyncClient("pgk_0123456789ab_" + "A" * 43, base_urls=[f"http://{host}" for host in hosts],
                       http_transport=httpx.MockTransport(handler), **options)


def _scripted(script: dict[str, list]) -> tuple[object, list[str]]:
    """A mock transport's handler over several regions (hosts): each inference request gets its
    host's next scripted answer (a status with a code, an exception to raise, or "ok"; the last one
    repeats); the hosts asked, in order."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if (token := _token(request)) is not None:
            return token
        host = request.url.host
        asked.append(host)
        answers = script[host]
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        if answer == "ok":
            return _chat()
        status, code, *headers = answer
        return httpx.Response(status, headers=dict(headers), json={"error": {
            "message": code, "type": "service_unavailable" if status >= 500 else "invalid_request_error",
            "param": None, "code": code}})

    return handler, asked


def _token(request: httpx.Request) -> httpx.Response | None:
    if request.url.path == "/v1/auth/token":
        return httpx.Response(200, json={"access_token": "t", "token_type": "Bearer", "expires_in": 900})
    return None


def _models() -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": []})


def _chat() -> httpx.Response:
    return httpx.Response(200, json={
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def test_an_unreachable_region_is_asked_again_beside_one_that_answered_without_a_retry_after():
    """Held back for region_hold_s (the whole budget) whenever another region answered, the region
    that had refused one connect was never asked again: a call the older client served failed."""
    assert _served({"a": [(500, "gateway_unavailable")], "b": [httpx.ConnectError("refused"), "ok"]})[-1] == "b"


def test_a_region_that_said_model_not_found_is_not_asked_again():
    """a: busy, then it does not serve the model (unloaded meanwhile); b: busy for a second each
    time. a was asked at every later round all the same."""
    handler, asked = _scripted({"a": [(503, "overloaded"), (404, "model_not_found")],
                                "b": [(503, "overloaded", ("retry-after", "1"))]})

    async def scenario():
        async with _mock_client(handler, hosts=("a", "b"), max_retries=3) as client:
            with pytest.raises(ServiceUnavailableError) as err:
                await client.chat_completion(REQUEST)
            return err.value

    assert asyncio.run(scenario()).retry_after == 1.0  # b's word, not a's 404
    assert asked.count("a") == 2 and asked.count("b") == 3


def _served(script: dict[str, list]) -> list[str]:
    """A completion through the scripted regions (in the script's order), served in the end: the
    regions asked, in order."""
    handler, asked = _scripted(script)

    async def scenario():
        async with _mock_client(handler, hosts=tuple(script)) as client:
            return await client.chat_completion(REQUEST)

    assert asyncio.run(scenario()).choices[0].message.content == "hi"
    return asked


@pytest.mark.parametrize("then", [(404, "model_not_found"), (503, "overloaded", ("retry-after", "60"))])
def test_after_a_429_round_the_regions_not_asked_yet_are(then):
    """A 429's rounds ask its own region alone; when that region then fails otherwise, the
    regions never asked in this call were left out (only the asked ones were due)."""
    assert _served({"a": [(429, "rate_limit_exceeded", ("retry-after-ms", "10")), then], "b": ["ok"]}) == [
        "a", "a", "b"]


def test_a_region_that_refused_a_connect_is_asked_again_when_the_other_says_wait_past_the_budget():
    """A cold model's 503 says 60 s, past the call's 30 s: the region that refused one connect was
    held that long too, so the call ended at once though that region had come back."""
    assert _served({"a": [(503, "model_cold", ("retry-after", "60"))],
                    "b": [httpx.ConnectError("refused"), "ok"]}) == ["a", "b", "b"]


def test_a_post_whose_answer_broke_after_its_head_is_not_resent():
    """httpx reads a non-stream body inside send: a 200 cut mid-body raised as a protocol error
    on a pooled connection within the second, and the completion was posted again (run and
    billed twice)."""
    calls: list[str] = []

    class CutBody(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'{"id": "c", "object": '
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def handler(request: httpx.Request) -> httpx.Response:
        if (token := _token(request)) is not None:
            return token
        calls.append(request.method)
        await request.extensions["trace"]("http11.receive_response_headers.complete", {})
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=CutBody())

    async def scenario():
        async with _mock_client(handler) as client:
            with pytest.raises(APIConnectionError):
                await client.chat_completion(REQUEST)

    asyncio.run(scenario())
    assert calls == ["POST"]


def test_a_reset_on_a_pooled_connection_is_not_resent_for_a_post():
    """A reset may come from a server that had the request: only where nothing runs twice."""
    handler, asked = _scripted({"mock": [httpx.ReadError("connection reset by peer"), "ok"]})

    async def scenario():
        async with _mock_client(handler) as client:
            with pytest.raises(APIConnectionError, match="ReadError"):
                await client.chat_completion(REQUEST)

    asyncio.run(scenario())
    assert asked == ["mock"]


def test_a_pooled_connection_the_server_closed_is_sent_again_once_even_for_a_post():
    """An ingress reload closes idle keep-alive connections: the request on one breaks at once,
    having run nothing, and was raised (one failed request per pooled connection per deploy)."""
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if (token := _token(request)) is not None:
            return token
        calls.append(request.url.path)
        if len(calls) in (1, 3, 4):  # no connect in the trace: a pooled connection
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return _models() if request.method == "GET" else _chat()

    async def scenario():
        async with _mock_client(handler, max_retries=0) as client:
            assert (await client.chat_completion(REQUEST)).choices[0].message.content == "hi"
            with pytest.raises(APIConnectionError):  # broken twice: the second time may have run
                await client.chat_completion(REQUEST)

    asyncio.run(scenario())
    assert calls == ["/v1/chat/completions"] * 4


def test_a_line_that_breaks_on_a_new_connection_is_resent_for_a_get_and_raised_for_a_post():
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if (token := _token(request)) is not None:
            return token
        calls.append(request.method)
        if len(calls) in (1, 3):
            await request.extensions["trace"]("connection.connect_tcp.complete", {})  # it opened its own
            raise httpx.ReadError("connection reset")
        return _models() if request.method == "GET" else _chat()

    async def scenario():
        async with _mock_client(handler) as client:
            assert (await client.models()).data == []  # broken once, asked again
            with pytest.raises(APIConnectionError):  # a generation may be running: not sent twice
                await client.chat_completion(REQUEST)

    asyncio.run(scenario())
    assert calls == ["GET", "GET", "POST"]


def test_a_closed_client_says_so_in_its_own_error():
    async def scenario():
        client = _mock_client(lambda request: _token(request) or _models())
        await client.close()
        with pytest.raises(ServeAppError, match="closed"):
            await client.models()

    asyncio.run(scenario())


def test_a_stream_closed_by_another_task_raises_instead_of_ending_as_if_complete():
    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.stream_events(seen, pieces=("x",) * 50), delay_s=0.02))

    async def scenario(client):
        stream = client.chat_completion_stream(REQUEST)
        got = 0
        with pytest.raises(APIConnectionError, match="closed before its end"):
            async for _ in stream:
                got += 1
                if got == 5:
                    asyncio.get_running_loop().create_task(stream.aclose())  # a shutdown handler's
        return got, stream.ended

    got, ended = run_client(region, scenario)
    assert 5 <= got < 50 and not ended


def test_an_error_carries_the_request_id_headers_and_a_proxys_body():
    request = httpx.Request("POST", "http://x/v1/chat/completions")
    page = httpx.Response(502, text="<html>upstream connect error</html>", headers={"x-request-id": "req-1"},
                          request=request)
    err = from_response(page, region=None, trace_id="t")
    assert (err.request_id, err.body, err.json_body) == ("req-1", "<html>upstream connect error</html>", False)
    assert err.headers["x-request-id"] == "req-1"
    anthropic = httpx.Response(529, request=request, json={
        "type": "error", "error": {"type": "overloaded_error", "message": "busy"}, "request_id": "req-2"})
    assert from_response(anthropic, region=None, trace_id=None).request_id == "req-2"


def test_every_error_pickles_with_its_fields():
    """A worker pool hands its errors to its parent: a status error failed to unpickle."""
    err = RateLimitError("slow down", status=429, code="rate_limit_exceeded", retry_after=2.0, region="yul-02",
                         request_id="req-1", headers={"retry-after": "2"})
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is RateLimitError and str(again) == str(err)
    assert (again.status, again.code, again.retry_after, again.region, again.request_id, again.headers) == (
        429, "rate_limit_exceeded", 2.0, "yul-02", "req-1", {"retry-after": "2"})
    lost = pickle.loads(pickle.dumps(APIConnectionError("cannot connect", region="a", trace_id="t")))
    assert (type(lost), lost.message, lost.region, lost.trace_id) == (APIConnectionError, "cannot connect", "a", "t")


@pytest.mark.parametrize("value, seconds", [
    ("Wed, 21 Oct 2015 07:28:05 GMT", 5.0),  # a date 5 s ahead of "now"
    ("Wed, 21 Oct 2015 07:27:00 GMT", 0.0),  # a date past: now
    ("inf", None), ("nan", None), ("-1", None), ("soon", None), ("3", 3.0),
])
def test_retry_after_takes_an_http_date_and_refuses_what_is_no_wait(value, seconds):
    assert retry_after_s({"retry-after": value}, now=1445412480.0) == seconds


def test_connections_are_kept_alive_to_the_limit_and_a_full_pool_says_so():
    """httpx kept 20 of its 100 connections alive: past 20 concurrent calls each opened a new one.
    A call that found every connection taken timed out as if the server had not answered."""
    from serve_app.client.transport import DEFAULT_LIMITS

    assert DEFAULT_LIMITS.max_keepalive_connections == DEFAULT_LIMITS.max_connections == 100
    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.stream_events(seen, pieces=("x",) * 20), delay_s=0.05))

    async def scenario(client):
        async with client.chat_completion_stream(REQUEST) as stream:  # holds the one connection
            await anext(stream)
            with pytest.raises(APITimeoutError, match="all 1 connections of this client were in use"):
                await client.chat_completion(REQUEST, timeout=httpx.Timeout(5.0, pool=0.2))

    run_client(region, scenario, limits=httpx.Limits(max_connections=1))
    assert len(region.inference()) == 1  # the second call was never sent
