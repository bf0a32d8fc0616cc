"""``client.responses`` and ``client.messages`` (serve_app/client/resources.py) against fake regions
on 127.0.0.1 (``client_fake_server.py``), and once against the real router on the fake engine:
typed answers and events, the server's timing from where each protocol carries it, mid-stream
errors raised typed, a stream cut short never looking complete, failover shared with chat, and the
sync twin."""

import httpx
import pytest

from auth_support import DEV_KEY, MODEL
from serve_app.client import (
    APIConnectionError,
    AsyncClient,
    BadRequestError,
    Client,
    Message,
    MessageStreamEvent,
    MessageTokensCount,
    NotFoundError,
    Response,
    ResponseDeleted,
    ResponseStreamEvent,
    ServiceUnavailableError,
)
from serve_app.router import ingress
from tests.unit.client_fake_server import FakeRegion, error, serving, sse, streaming, unavailable
from tests.unit.client_fake_server import run_client as run

ASK = {"model": "qwen-3.6-a3b", "input": "Say hi.", "max_output_tokens": 16}
MESSAGE = {"model": "qwen-3.6-a3b", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hi."}]}




def assert_timed(timing, seen, region="yul-02"):
    assert (timing.inference_ttft_ms, timing.inference_total_ms, timing.server_ms) == (12.5, 20.0, 21.75)
    assert timing.region == region and timing.trace_id == seen.trace_id


# --- Responses ----------------------------------------------------------------------------------


def test_responses_create_retrieve_and_delete():
    region = FakeRegion("yul-02")

    async def scenario(client):
        created = await client.responses.create(ASK, temperature=0)
        kept = await client.responses.retrieve(created.id)
        deleted = await client.responses.delete(created.id)
        with pytest.raises(NotFoundError) as gone:
            await client.responses.retrieve(created.id)
        return created, kept, deleted, gone.value

    created, kept, deleted, gone = run(region, scenario)
    assert isinstance(created, Response) and created.output_text == "Hi there." and created.usage.output_tokens == 3
    seen = region.inference()[0]
    assert seen.path == "/v1/responses" and seen.body == {**ASK, "temperature": 0}  # as given, no `stream`
    assert_timed(created.timing, seen)
    assert created.timing.server_timing["total"] == 21.75
    assert "pg_metadata" in created.model_dump()  # the body as the server sent it
    assert isinstance(kept, Response) and kept.id == created.id and kept.output_text == "Hi there."
    assert isinstance(deleted, ResponseDeleted) and deleted.deleted and deleted.id == created.id
    assert gone.status == 404 and gone.param == "response_id"


def test_a_responses_stream_yields_typed_events_up_to_its_terminal_one_then_the_timing_and_response():
    region = FakeRegion("yul-02")

    async def scenario(client):
        stream = client.responses.stream(ASK)
        events = []
        async for event in stream:
            events.append(event)
            if event.type != "response.completed":
                assert stream.timing is None and stream.response is None  # only once it has ended
        return stream, events

    stream, events = run(region, scenario)
    assert all(isinstance(e, ResponseStreamEvent) for e in events)
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and stream.ended
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hi there."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.usage is None  # null until known
    seen = region.inference()[0]
    assert seen.body == {**ASK, "stream": True}
    assert_timed(stream.timing, seen)
    final = stream.response
    assert isinstance(final, Response) and final.output_text == "Hi there." and final.usage.total_tokens == 8
    assert final.timing is stream.timing and stream.region == "yul-02"


def test_an_incomplete_response_ends_the_stream_too():
    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.responses_events(seen, status="incomplete")))

    async def scenario(client):
        stream = client.responses.stream(ASK)
        return stream, [event.type async for event in stream]

    stream, kinds = run(region, scenario)
    assert kinds[-1] == "response.incomplete" and stream.response.status == "incomplete"
    assert stream.timing.inference_total_ms == 20.0


@pytest.mark.parametrize("event", [
    # The router's: OpenAI's fields and Open Responses' error object.
    {"type": "error", "code": "engine_unavailable", "message": "the model engine failed; retry", "param": None,
     "sequence_number": 4, "error": {"type": "service_unavailable", "code": "engine_unavailable",
                                     "message": "the model engine failed; retry", "param": None}},
    # OpenAI's alone (an older region).
    {"type": "error", "code": "engine_unavailable", "message": "the model engine failed; retry", "param": None,
     "sequence_number": 4},
])
def test_a_responses_error_event_is_raised_typed_and_the_stream_has_no_timing(event):
    region = FakeRegion("a")
    region.answers.append(lambda seen: streaming(region.responses_events(seen)[:3] + [sse(event, event="error")]))

    async def scenario(client):
        stream = client.responses.stream(ASK)
        kinds = []
        with pytest.raises(ServiceUnavailableError) as err:
            async for item in stream:
                kinds.append(item.type)
        return stream, kinds, err.value

    stream, kinds, err = run(region, scenario)
    assert kinds == ["response.created", "response.in_progress", "response.output_text.delta"]
    assert err.status == 503 and err.code == "engine_unavailable" and err.during_stream
    assert stream.timing is None and not stream.ended and len(region.inference()) == 1  # never resent


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_a_stream_cut_before_its_terminal_event_is_a_connection_error(route):
    region = FakeRegion("a")

    def cut(seen):
        events = region.responses_events(seen) if route == "responses" else region.messages_events(seen)
        return streaming(events[:-1])

    region.answers.append(cut)

    async def scenario(client):
        stream = getattr(client, route).stream(ASK if route == "responses" else MESSAGE)
        with pytest.raises(APIConnectionError) as err:
            async for _ in stream:
                pass
        return stream, err.value

    stream, err = run(region, scenario)
    assert "before its terminal event" in err.message and not stream.ended and stream.timing is None


def test_responses_and_messages_fail_over_to_the_next_region_like_chat():
    first, second = FakeRegion("a"), FakeRegion("b")
    second.api_key, second.tokens = first.api_key, first.tokens  # one key, one keyset
    first.answers.append(unavailable(code="model_cold"))  # Retry-After 1: held back for the next call too

    async def scenario(client):
        created = await client.responses.create(ASK)
        stream = client.messages.stream(MESSAGE)
        kinds = [event.type async for event in stream]
        return created, stream, kinds

    created, stream, kinds = run(first, scenario, regions=(second,))
    assert created.timing.region == "b" and first.statuses == [503] and second.statuses == [200, 200]
    assert kinds[-1] == "message_stop" and stream.region == "b"


def test_the_stream_method_decides_stream():
    region = FakeRegion("a")

    async def scenario(client):
        with pytest.raises(ValueError):
            await client.responses.create(ASK, stream=True)
        with pytest.raises(ValueError):
            client.messages.stream(MESSAGE, stream=False)

    run(region, scenario)
    assert region.inference() == []


# --- Messages -----------------------------------------------------------------------------------


def test_messages_create_and_count_tokens_are_typed_and_timed():
    region = FakeRegion("yul-02")

    async def scenario(client):
        return await client.messages.create(MESSAGE), await client.messages.count_tokens(
            model=MESSAGE["model"], messages=MESSAGE["messages"])

    message, counted = run(region, scenario)
    sent, count_seen = region.inference()
    assert isinstance(message, Message) and message.content[0].text == "Hi there." and message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 3 and sent.path == "/v1/messages" and sent.body == MESSAGE
    assert_timed(message.timing, sent)
    assert isinstance(counted, MessageTokensCount) and counted.input_tokens == 9
    assert count_seen.path == "/v1/messages/count_tokens" and "stream" not in count_seen.body
    assert_timed(counted.timing, count_seen)


def test_a_messages_stream_yields_typed_events_up_to_message_stop_then_the_timing():
    region = FakeRegion("yul-02")

    async def scenario(client):
        stream = client.messages.stream(MESSAGE)
        return stream, [event async for event in stream]

    stream, events = run(region, scenario)
    assert all(isinstance(e, MessageStreamEvent) for e in events)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "ping" not in kinds
    assert "".join(e.delta["text"] for e in events if e.type == "content_block_delta") == "Hi there."
    assert events[0].message.usage.input_tokens == 5 and stream.ended
    assert_timed(stream.timing, region.inference()[0])


def test_an_anthropic_error_event_and_an_anthropic_error_body_are_raised_typed():
    region = FakeRegion("a")
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "the model engine failed"},
                  "request_id": None}
    region.answers.append(lambda seen: streaming(region.messages_events(seen)[:2] + [sse(overloaded, event="error")]))
    refused = {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: must be >= 1"},
               "request_id": None}
    from starlette.responses import JSONResponse

    region.answers.append(JSONResponse(refused, status_code=400))

    async def scenario(client):
        with pytest.raises(ServiceUnavailableError) as mid:
            async for _ in client.messages.stream(MESSAGE):
                pass
        with pytest.raises(BadRequestError) as before:
            await client.messages.create(MESSAGE, max_tokens=0)
        return mid.value, before.value

    mid, before = run(region, scenario)
    assert mid.status == 503 and mid.type == "overloaded_error" and mid.during_stream
    assert before.status == 400 and before.message == "max_tokens: must be >= 1" and not before.during_stream


# --- the sync twin ------------------------------------------------------------------------------


def test_the_sync_client_has_the_same_groups():
    region = FakeRegion("yul-02")
    with serving(region) as urls:
        with Client.create(region.api_key, base_url=urls[0]) as client:
            created = client.responses.create(ASK)
            stream = client.responses.stream(ASK)
            kinds = [event.type for event in stream]
            kept = client.responses.retrieve(created.id)
            deleted = client.responses.delete(created.id)
            message = client.messages.create(MESSAGE)
            message_stream = client.messages.stream(MESSAGE)
            message_kinds = [event.type for event in message_stream]
            counted = client.messages.count_tokens(model=MESSAGE["model"], messages=MESSAGE["messages"])
    assert created.output_text == "Hi there." and created.timing.region == "yul-02"
    assert kinds[-1] == "response.completed" and stream.response.output_text == "Hi there." and stream.timing.server_ms
    assert kept.id == created.id and deleted.deleted
    assert message.content[0].text == "Hi there." and message.timing.inference_ttft_ms == 12.5
    assert message_kinds[-1] == "message_stop" and message_stream.timing.server_ms == 21.75
    assert counted.input_tokens == 9


def test_the_sync_client_closes_once_refuses_calls_after_and_stops_its_thread_when_dropped():
    import gc
    import threading
    import warnings

    from serve_app.client import ServeAppError

    region = FakeRegion("yul-02")
    with serving(region) as urls:
        with Client.create(region.api_key, base_url=urls[0]) as client:
            client.messages.count_tokens(model=MESSAGE["model"], messages=MESSAGE["messages"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "coroutine was never awaited"
            client.close()  # a second close: nothing to do
            with pytest.raises(ServeAppError, match="closed"):
                client.models()
        embeddings = Client.create(region.api_key, base_url=urls[0]).embeddings  # its client dropped at once
        gc.collect()
        assert embeddings.create(model="qwen-3-embedding-0.6b", input=["one"]).data  # the group keeps its loop
        dropped = Client(region.api_key, base_url=urls[0])  # never closed
        thread = dropped._loop.thread
        del dropped
        gc.collect()
    thread.join(5)  # a hang guard: stopping the loop ends the thread at once
    assert not thread.is_alive() and thread not in threading.enumerate()


# --- against the real router --------------------------------------------------------------------


def test_the_client_reads_the_real_routers_responses_and_messages_streams(router_app):
    """The router (its closing, on the fake engine's vLLM events) and the client agree on where
    each protocol puts the timing."""
    app = router_app()

    async def go():
        transport = httpx.ASGITransport(app=ingress.app)
        async with AsyncClient(DEV_KEY, base_url="http://router.test", http_transport=transport) as client:
            stream = client.responses.stream(model=MODEL, input="hi", max_output_tokens=4)
            kinds = [event.type async for event in stream]
            kept = await client.responses.retrieve(stream.response.id)
            messages = client.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            message_kinds = [event.type async for event in messages]
            message = await client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            return stream, kinds, kept, messages, message_kinds, message

    stream, kinds, kept, messages, message_kinds, message = app.run(go)
    assert kinds[-1] == "response.completed" and stream.response.output_text == "t1 t2 t3 t4 "
    assert stream.timing.inference_total_ms == 5.0 and stream.timing.region == "local"
    assert kept.id == stream.response.id and "pg_metadata" not in kept.model_dump()
    assert message_kinds[-1] == "message_stop" and messages.timing.inference_ttft_ms == 2.0
    assert message.content[0].text == "t1 t2 t3 " and message.timing.inference_total_ms == 5.0
