"""serve_app.client streams and timing against a fake region on 127.0.0.1: typed chunks, the
server's timing once a stream ends, a mid-stream error event raised as a typed error, no retry
after a stream has started, and the same timing on JSON responses."""

import pytest
from starlette.responses import JSONResponse

from serve_app.client import (
    APIConnectionError,
    APITimeoutError,
    BadRequestError,
    ChatCompletionChunk,
    InternalServerError,
    ServeAppError,
    ServiceUnavailableError,
)
from tests.unit.client_fake_server import MODEL, SERVER_TIMING, FakeRegion, error, sse, streaming
from tests.unit.client_fake_server import run_client as run

MESSAGES = [{"role": "user", "content": "Say hi in one short sentence."}]
REQUEST = {"model": "qwen-3.6-a3b", "messages": MESSAGES, "max_tokens": 32}




def test_the_model_cards_loop_works_and_timing_is_readable_after_the_stream():
    region = FakeRegion("yul-02")

    async def scenario(client):
        stream = client.chat_completion_stream(REQUEST)
        assert stream.timing is None and stream.region is None  # nothing sent yet
        chunks, text = [], ""
        async for chunk in stream:
            chunks.append(chunk)
            content = chunk.choices[0].delta.content
            if content:
                text += content
            assert stream.timing is None  # only once it has ended
        return stream, chunks, text

    stream, chunks, text = run(region, scenario)
    assert text == "Hi there."
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert len(chunks) == 5  # role, 3 pieces, finish: the pg_metadata event is not a chunk
    assert chunks[-1].choices[0].finish_reason == "stop"
    (seen,) = region.inference()
    timing = stream.timing
    assert (timing.inference_ttft_ms, timing.inference_total_ms, timing.queue_ms, timing.network_ms) == (12.5, 20.0, 0.25, 1.5)
    assert (timing.server_ms, timing.region, timing.replica, timing.alias) == (21.75, "yul-02", "model-1", "qwen-3.6-a3b")
    assert stream.region == "yul-02" and stream.ended
    assert stream.trace_id == timing.trace_id == seen.trace_id  # the trace the client started
    assert seen.body == REQUEST | {"stream": True}


def test_json_responses_carry_the_same_timing_from_pg_metadata_and_server_timing():
    region = FakeRegion("yul-02")

    async def scenario(client):
        return await client.chat_completion(REQUEST), await client.completion(model=MODEL, prompt="Hi", max_tokens=4)

    chat, completion = run(region, scenario)
    for reply, seen in zip((chat, completion), region.inference()):
        assert reply.timing.inference_ttft_ms == 12.5 and reply.timing.region == "yul-02"
        assert reply.timing.server_timing == {"network": 1.5, "queue": 0.25, "inference": 20.0, "total": 21.75}
        assert reply.timing.trace_id == seen.trace_id
        assert "pg_metadata" in reply.model_dump()  # the body as the server sent it
    assert completion.choices[0].text == "Hi there."
    assert chat.usage.total_tokens == 8


def test_server_timing_alone_still_gives_the_split():
    # A JSON answer with only the header (no pg_metadata field): the split comes from the header.
    region = FakeRegion("a")
    body = {"id": "x", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
    region.answers.append(JSONResponse(body, headers={"Server-Timing": SERVER_TIMING}))

    async def scenario(client):
        return await client.chat_completion(REQUEST)

    timing = run(region, scenario).timing
    assert (timing.network_ms, timing.queue_ms, timing.inference_total_ms, timing.server_ms) == (1.5, 0.25, 20.0, 21.75)
    assert timing.inference_ttft_ms is None and timing.region == "a"
    assert timing.trace_id == region.inference()[0].trace_id


def test_an_error_response_carries_status_type_code_param_and_region():
    region = FakeRegion("a")
    region.answers.append(error(400, "temperature must be >= 0", type_="invalid_request_error", param="temperature"))

    async def scenario(client):
        with pytest.raises(BadRequestError) as err:
            await client.chat_completion(REQUEST, temperature=-1)
        return err.value

    err = run(region, scenario)
    assert (err.status, err.type, err.code, err.param, err.region) == (400, "invalid_request_error", None, "temperature", "a")
    assert err.message == "temperature must be >= 0" and len(region.inference()) == 1  # a 400 is not retried
    assert err.trace_id == region.inference()[0].trace_id


def test_an_error_event_mid_stream_is_raised_typed_and_not_retried():
    region, other = FakeRegion("a"), FakeRegion("b")
    failure = {"error": {"message": "the model engine failed during this stream; retry the request",
                         "type": "service_unavailable", "param": None, "code": "engine_unavailable"}}

    def answer(seen):
        return streaming(region.stream_events(seen)[:2] + [sse(failure), sse("[DONE]")])

    region.answers.append(answer)

    async def scenario(client):
        got = []
        with pytest.raises(ServiceUnavailableError) as err:
            async for chunk in client.chat_completion_stream(REQUEST):
                got.append(chunk.choices[0].delta.content)
        return got, err.value

    got, err = run(region, scenario, regions=[other])
    assert got == ["", "Hi"]
    assert (err.status, err.type, err.code, err.during_stream, err.region) == (
        503, "service_unavailable", "engine_unavailable", True, "a")
    assert len(region.inference()) == 1 and other.inference() == []  # no retry, no failover


def test_a_peer_stream_failure_event_is_a_502():
    region = FakeRegion("a")
    broke = {"error": {"message": "peer broke off", "type": "server_error", "param": None, "code": "peer_stream_failed"}}
    region.answers.append(lambda seen: streaming(region.stream_events(seen)[:1] + [sse(broke), sse("[DONE]")]))

    async def scenario(client):
        with pytest.raises(InternalServerError) as err:
            async for _ in client.chat_completion_stream(REQUEST):
                pass
        return err.value

    err = run(region, scenario)
    assert (err.status, err.code) == (502, "peer_stream_failed")


@pytest.mark.parametrize("cut", ["closed_cleanly", "connection_reset"])
def test_a_stream_cut_before_done_raises_and_is_never_resent(cut):
    region = FakeRegion("a")

    def boom():
        raise RuntimeError("cut")  # uvicorn drops the connection mid-body

    region.answers.append(lambda seen: streaming(region.stream_events(seen)[:3],
                                                 then=boom if cut == "connection_reset" else None))

    async def scenario(client):
        got = []
        with pytest.raises(APIConnectionError) as err:
            async for chunk in client.chat_completion_stream(REQUEST):
                got.append(chunk)
        return got, err.value

    got, err = run(region, scenario)
    assert len(got) == 3 and err.trace_id == region.inference()[0].trace_id
    assert len(region.inference()) == 1


def test_a_stalled_stream_times_out():
    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.stream_events(seen), delay_s=1.0))

    async def scenario(client):
        with pytest.raises(APITimeoutError):
            async for _ in client.chat_completion_stream(REQUEST, timeout=0.3):
                pass

    run(region, scenario)
    assert len(region.inference()) == 1


def test_a_stream_left_early_can_be_closed_and_the_client_keeps_working():
    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.stream_events(seen), delay_s=0.05))

    async def scenario(client):
        async with client.chat_completion_stream(REQUEST) as stream:
            async for _ in stream:
                break
        assert stream.timing is None and not stream.ended
        return (await client.chat_completion(REQUEST)).choices[0].message.content

    assert run(region, scenario) == "Hi there."


def test_a_callers_traceparent_is_sent_and_its_trace_id_returned():
    region = FakeRegion("a")
    traceparent = "00-" + "4bf92f3577b34da6a3ce929d0e0e4736" + "-" + "00f067aa0ba902b7" + "-01"

    async def scenario(client):
        stream = client.chat_completion_stream(REQUEST, traceparent=traceparent)
        async for _ in stream:
            pass
        return stream

    stream = run(region, scenario)
    (seen,) = region.inference()
    assert seen.headers["traceparent"] == traceparent and "traceparent" not in seen.body
    assert stream.trace_id == stream.timing.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_every_request_gets_its_own_trace_and_the_sampling_flag_follows_the_ratio():
    region = FakeRegion("a")

    async def scenario(client):
        for _ in range(3):
            await client.chat_completion(REQUEST)

    run(region, scenario, trace_sample_ratio=0.0)
    parents = [s.headers["traceparent"] for s in region.inference()]
    assert len({p.split("-")[1] for p in parents}) == 3
    assert all(p.startswith("00-") and p.endswith("-00") for p in parents)


def test_the_method_decides_stream_and_the_clients_keywords_stay_out_of_the_body():
    region = FakeRegion("a")

    async def scenario(client):
        with pytest.raises(ValueError):
            await client.chat_completion(REQUEST, stream=True)
        await client.chat_completion({**REQUEST, "top_k": 20}, max_tokens=4, timeout=30, extra_headers={"x-test": "1"})

    run(region, scenario)
    (seen,) = region.inference()
    assert seen.body == {**REQUEST, "top_k": 20, "max_tokens": 4}
    assert seen.headers["x-test"] == "1"


def test_models_lists_cards_with_their_extras():
    region = FakeRegion("a")

    async def scenario(client):
        return await client.models()

    models = run(region, scenario)
    (card,) = models.data
    assert card.id == MODEL and card.state == "loaded" and card.region == "a"


def test_a_stream_walked_away_from_closes_its_connection():
    # A `break` with no `async with`, the stream then dropped: its response is closed (the pooled
    # connection freed, the server told), not held until the client closes.
    import asyncio
    import gc

    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.stream_events(seen), delay_s=0.05))

    async def scenario(client):
        stream = client.chat_completion_stream(REQUEST)
        async for _ in stream:
            break
        response = stream._sent.response
        del stream
        gc.collect()
        for _ in range(50):  # the finalizer's close is scheduled on the loop
            if response.is_closed:
                break
            await asyncio.sleep(0.01)
        return response.is_closed

    assert run(region, scenario)


def test_a_stream_without_a_timeout_of_its_own_times_out_after_stream_read_timeout_s():
    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.stream_events(seen), delay_s=1.0))

    async def scenario(client):
        with pytest.raises(APITimeoutError):
            async for _ in client.chat_completion_stream(REQUEST):
                pass
        return await client.chat_completion(REQUEST)  # a JSON answer keeps the client's 600 s read

    run(region, scenario, stream_read_timeout_s=0.3)


def test_keep_alive_comments_keep_an_open_stream_from_timing_out():
    """A long prefill or a resume elsewhere sends no event for a while, but a comment every second
    (the router's keep-alive): the connection is alive, and the stream is not cut."""
    region = FakeRegion("a")
    events = region.stream_events
    region.answers.append(lambda seen: streaming([*events(seen)[:1], *[b": keep-alive\n\n"] * 8, *events(seen)[1:]],
                                                 delay_s=0.1))

    async def scenario(client):
        return "".join([c.choices[0].delta.content or "" async for c in client.chat_completion_stream(REQUEST)])

    assert run(region, scenario, stream_read_timeout_s=0.3) == "Hi there."  # 0.9 s with no event


def test_an_event_the_client_cannot_read_is_its_error_and_closes_the_stream():
    region = FakeRegion("a")
    bad = sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": "not a list"})
    region.answers.append(lambda seen: streaming([bad, *region.stream_events(seen)]))

    async def scenario(client):
        stream = client.chat_completion_stream(REQUEST)
        with pytest.raises(ServeAppError, match="cannot read"):
            async for _ in stream:
                pass
        return stream._sent.response.is_closed

    assert run(region, scenario)


def test_an_error_whose_body_broke_off_is_still_a_typed_error():
    # The status line said 503, then the body's read failed: the error is the status's, unread body and all.
    import httpx

    from serve_app.client.errors import from_response

    response = httpx.Response(503, headers={"retry-after": "2"}, stream=httpx.ByteStream(b""),
                              request=httpx.Request("POST", "http://127.0.0.1/v1/chat/completions"))
    err = from_response(response, region="a", trace_id=None)  # never read: json() raises ResponseNotRead
    assert isinstance(err, ServiceUnavailableError) and (err.status, err.retry_after) == (503, 2)


def test_a_stream_whose_status_line_waits_in_the_servers_queue_is_not_cut_by_stream_read_timeout_s():
    """Before its head the server sends nothing (Serve's queue): only an open stream's silence is
    bounded by stream_read_timeout_s; the status line has the client's read timeout."""
    import time

    region = FakeRegion("a")

    def queued(seen):
        time.sleep(0.8)  # blocks this fake region's loop: no byte, not even the status line
        return streaming(region.stream_events(seen))

    region.answers.append(queued)

    async def scenario(client):
        return "".join([c.choices[0].delta.content or "" async for c in client.chat_completion_stream(REQUEST)])

    assert run(region, scenario, stream_read_timeout_s=0.3) == "Hi there."
