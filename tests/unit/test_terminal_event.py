"""The terminal event of a Responses or Messages stream, held back by the replica and written last
by the router with the request's timing inside it (docs/api.md, "Server timing").

The replica side (``engine/outputs.py``): the watcher passes every event but the terminal one on,
and puts that one in the trailer (``Trailer.terminal``); the final response stays in
``Trailer.response`` for the store, without timing. The router side (``surfaces/dialects.py``):
the closing is that event with ``pg_metadata`` inside it — ``response.pg_metadata`` for Responses,
a ``pg_metadata`` field of ``message_stop`` for Messages — and nothing when the stream has no
terminal event (it ended with an error event, which stays the last one).
"""

import asyncio
import json
from types import SimpleNamespace

import pytest

import fake_vllm
from fake_engine import DELTA, TIMING, FakeEngine
from serve_app.config import ModelDeploymentArgs
from serve_app.engine import outputs
from serve_app.engine.vllm_engine import VLLMEngine
from serve_app.surfaces import dialects
from serve_app.wire.messages import Call
from serve_app.wire.sse import data_of
from tests.schema_validation import validate, validate_responses

MODEL = "qwen-3.6-35b-a3b"
METADATA = {"inference_ttft_ms": 2.0, "inference_total_ms": 5.0, "server_ms": 9.0, "trace_id": "ab" * 16}


def responses_events(body, *, tokens=3, limit=3):
    """vLLM's Responses events for a generation of ``tokens`` tokens (of ``limit`` allowed)."""
    engine = FakeEngine(tokens=tokens)
    request = fake_vllm.validated_responses_request({**body, "store": False})
    generation = engine.generate({"prompt_token_ids": [1] * 5}, DELTA, "r1", max_tokens=min(tokens, limit))
    return fake_vllm.responses_events(request, generation, wanted=min(tokens, limit), total=tokens, prompt_tokens=5,
                                      cached=0, metrics=TIMING)


async def _passed_on(watcher, events) -> list[str | None]:
    return [watcher.pass_on(event) async for event in events]


def named(frame: str) -> tuple[str, dict]:
    name, _, _ = frame.partition("\n")
    return name.removeprefix("event: "), data_of(frame)


# --- the replica ----------------------------------------------------------------------------------


@pytest.mark.parametrize("limit, terminal", [(3, "response.completed"), (2, "response.incomplete")])
def test_the_responses_watcher_holds_back_the_terminal_event_for_the_trailer(limit, terminal):
    body = {"model": MODEL, "input": "hi", "stream": True}
    watcher = outputs.ResponsesOutput().watcher(body)
    passed = asyncio.run(_passed_on(watcher, responses_events(body, limit=limit)))
    assert passed[-1] is None and None not in passed[:-1]  # only the terminal event is held back
    assert all(named(frame)[0] not in outputs.ResponsesStream.TERMINAL for frame in passed[:-1])
    trailer = watcher.trailer()
    assert trailer.terminal["type"] == terminal and trailer.terminal["sequence_number"] == len(passed) - 1
    assert trailer.terminal["response"] is trailer.response  # one object: pickled once across the handle
    assert "pg_metadata" not in trailer.response and "metrics" not in trailer.response
    assert trailer.usage["completion_tokens"] == limit and trailer.timing.decode_ms == 3.0
    validate_responses(trailer.terminal, event=True)


def test_the_messages_watcher_holds_back_message_stop_for_the_trailer():
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    engine = FakeEngine(tokens=3)
    watcher = outputs.MessagesOutput().watcher(body)
    chat = engine._events(engine.generate({"prompt_token_ids": [1] * 5}, DELTA, "r1", max_tokens=3), body)
    passed = asyncio.run(_passed_on(watcher, fake_vllm.messages_events(chat, watcher)))
    assert passed[-1] is None and None not in passed[:-1]
    assert named(passed[-2])[0] == "message_delta"
    trailer = watcher.trailer()
    assert trailer.terminal == {"type": "message_stop"}
    assert trailer.finish_reasons == ("max_tokens",) and trailer.timing.prefill_ms == 2.0


def test_a_continued_responses_stream_is_shaped_against_the_clients_body():
    """The engine's body says ``store: false`` (the router stores) and has no
    ``previous_response_id`` (the router put the conversation in its place): the stream's response
    objects must still echo what the client sent, as the non-stream answer does."""
    engine = VLLMEngine(ModelDeploymentArgs(id=MODEL), "/weights")

    async def create_responses(request, raw_request):
        return responses_events({"model": MODEL, "input": "hi"})

    engine._responses_serving = SimpleNamespace(create_responses=create_responses)
    call = Call({"model": MODEL, "input": "hi", "stream": True}, "r1", previous_response_id="resp_before")

    async def run():
        stream = await engine.on_responses(call)
        return await _passed_on(stream.watcher, stream.events), stream.watcher.trailer()

    passed, trailer = asyncio.run(run())
    objects = [named(frame)[1]["response"] for frame in passed[:2]] + [trailer.terminal["response"]]
    for response in objects:
        assert response["store"] is True and response["previous_response_id"] == "resp_before"


# --- the router's closing -----------------------------------------------------------------------


def test_the_responses_closing_is_the_terminal_event_with_the_timing_in_its_response():
    body = {"model": MODEL, "input": "hi", "stream": True}
    watcher = outputs.ResponsesOutput().watcher(body)
    asyncio.run(_passed_on(watcher, responses_events(body)))
    trailer = watcher.trailer()
    name, event = named(dialects.RESPONSES.closing(METADATA, terminal=trailer.terminal).decode())
    assert name == "response.completed" and event["response"]["pg_metadata"] == METADATA
    assert event["sequence_number"] == trailer.terminal["sequence_number"]
    assert "pg_metadata" not in trailer.response  # the store's copy is untouched
    validate_responses(event, event=True)


def test_the_messages_closing_is_message_stop_with_the_timing():
    frame = dialects.ANTHROPIC.closing(METADATA, terminal={"type": "message_stop"}).decode()
    assert named(frame) == ("message_stop", {"type": "message_stop", "pg_metadata": METADATA})
    validate("anthropic", "MessageStreamEvent", data_of(frame))


@pytest.mark.parametrize("dialect", [dialects.RESPONSES, dialects.ANTHROPIC])
def test_a_stream_without_a_terminal_event_gets_no_closing(dialect):
    """It ended with an error event, which must stay the last one."""
    assert dialect.closing(METADATA, terminal=None) == b""


def test_the_chat_closing_is_unchanged():
    closing = dialects.OPENAI.closing(METADATA, chunk_object="chat.completion.chunk", first={"id": "c1", "created": 7},
                                      model="m", usage=None, terminal=None).decode()
    timing, done = closing.split("\n\n")[:2]
    assert named(timing + "\n\n")[0] == "pg_metadata" and done == "data: [DONE]"
    assert json.loads(timing.split("data: ", 1)[1])["pg_metadata"] == METADATA


def test_a_chat_stream_that_ended_with_its_error_event_gets_only_done_no_timing():
    """docs/api.md: a failed stream ends with its error event and [DONE], without timing."""
    closing = dialects.OPENAI.closing(METADATA, chunk_object="chat.completion.chunk", first={"id": "c1"},
                                      model="m", usage=None, terminal=None, failed=True)
    assert closing == b"data: [DONE]\n\n"


# --- error events -------------------------------------------------------------------------------


@pytest.mark.parametrize("status, code", [(503, "engine_unavailable"), (500, "stream_failed"), (502, "peer_stream_failed")])
def test_a_responses_error_event_validates_against_both_specs(status, code):
    error = {"error": {"message": "the model engine failed", "type": "server_error", "param": None, "code": code}}
    frame = dialects.RESPONSES.error_event(status, error, sequence_number=12).decode()
    name, event = named(frame)
    assert name == "error" and event["sequence_number"] == 12
    assert event["code"] == event["error"]["code"] == code
    validate_responses(event, event=True)


def test_the_sequence_watch_finds_the_next_number_across_reads():
    watch = dialects.RESPONSES.sequence_watch()
    assert watch.next == 0
    frames = b"".join(f'event: x\ndata: {{"type":"x","sequence_number":{n}}}\n\n'.encode() for n in range(12))
    for start in range(0, len(frames), 7):  # reads that split the key and the number
        watch.saw(frames[start:start + 7])
    assert watch.next == 12
    assert dialects.ANTHROPIC.sequence_watch().next is None and dialects.OPENAI.sequence_watch().next is None


def test_the_anthropic_error_event_is_unchanged():
    error = {"error": {"message": "the model engine failed", "type": "server_error", "param": None, "code": None}}
    name, event = named(dialects.ANTHROPIC.error_event(503, error, sequence_number=None).decode())
    assert name == "error" and event["error"]["type"] == "overloaded_error"
    validate("anthropic", "ErrorResponse", event)
