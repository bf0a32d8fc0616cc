"""Anthropic Messages bodies, stream frames and errors from vLLM 0.32's own converters (fed chat
objects built from vLLM's protocol classes; no engine) fail Anthropic's schema as vLLM sends them
and pass once shaped. The schema is strict: every defaulted field is required
(tests/data/schemas/README.md).
"""

import asyncio
import copy
import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

from serve_app.engine import anthropic_shape
from tests.schema_validation import _document, errors, validate

REQUEST = {"model": "m", "max_tokens": 256, "messages": [{"role": "user", "content": "weather in SF?"}]}
CALL = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "SF"}'))
ANSWER = ChatMessage(role="assistant", content="Let me check.", reasoning="SF weather", tool_calls=[CALL])


def vllm_message(message=None, finish_reason="tool_calls", stop_reason=None, usage=None, **fields):
    """A Messages body as vLLM's router sends it: ``messages_full_converter`` (which uses nothing
    of its instance) over a chat response, dumped with ``exclude_none=True``."""
    chat = ChatCompletionResponse(
        id="chatcmpl-abc123",
        model="m",
        choices=[
            ChatCompletionResponseChoice(
                index=0,
                message=message or ANSWER,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
        ],
        usage=usage or UsageInfo(prompt_tokens=10, completion_tokens=5, total_tokens=15),
        **fields,
    )
    return AnthropicServingMessages.messages_full_converter(None, chat).model_dump(exclude_none=True)


def test_vllm_message_fails_the_schema_and_passes_once_shaped():
    body = vllm_message()
    assert [block["type"] for block in body["content"]] == ["thinking", "text", "tool_use"]
    before = errors("anthropic", "Message", body)
    for missing in ("stop_sequence", "stop_details", "container"):
        assert f"$: '{missing}' is a required property" in before
    assert "$.content[1]: 'citations' is a required property" in before
    assert "$.content[2]: 'caller' is a required property" in before
    assert "$.usage: 'cache_read_input_tokens' is a required property" in before
    validate("anthropic", "Message", anthropic_shape.message(body, REQUEST))
    Message.model_validate(body)  # and the SDK reads it


def test_shaped_message_adds_nulls_not_invented_values():
    body = anthropic_shape.message(vllm_message(), REQUEST)
    assert body["id"] == "msg_abc123"
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["stop_details"] is None and body["container"] is None
    thinking, text, tool_use = body["content"]
    assert thinking["thinking"] == "SF weather" and thinking["signature"]  # vLLM's, kept
    assert text == {"type": "text", "text": "Let me check.", "citations": None}
    assert tool_use == {
        "type": "tool_use",
        "id": "call_1",
        "name": "get_weather",
        "input": {"city": "SF"},
        "caller": {"type": "direct"},
    }
    assert body["usage"] == {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_creation": None,
        "cache_creation_input_tokens": None,
        "cache_read_input_tokens": None,
        "inference_geo": None,
        "output_tokens_details": None,
        "server_tool_use": None,
        "service_tier": None,
    }


def test_cache_counts_from_vllm_are_kept():
    details = PromptTokenUsageInfo(cached_tokens=4)
    usage = UsageInfo(prompt_tokens=10, completion_tokens=5, total_tokens=15, prompt_tokens_details=details)
    body = anthropic_shape.message(vllm_message(usage=usage), REQUEST)
    assert body["usage"]["cache_read_input_tokens"] == 4 and body["usage"]["input_tokens"] == 6
    validate("anthropic", "Message", body)


def test_matched_stop_sequence_is_kept():
    message = ChatMessage(role="assistant", content="one two")
    body = anthropic_shape.message(vllm_message(message, finish_reason="stop", stop_reason="END"), REQUEST)
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "END"
    validate("anthropic", "Message", body)


def test_unknown_finish_gives_a_null_stop_reason():
    body = vllm_message(ChatMessage(role="assistant", content="cut"), finish_reason="abort")
    assert "stop_reason" not in body  # vLLM maps an abort to None, and exclude_none drops it
    body = anthropic_shape.message(body, REQUEST)
    assert body["stop_reason"] is None
    validate("anthropic", "Message", body)


def test_transfer_params_only_when_the_request_set_them():
    raw = vllm_message(kv_transfer_params={"remote": 1})
    assert raw["kv_transfer_params"] == {"remote": 1}
    assert "kv_transfer_params" not in anthropic_shape.message(copy.deepcopy(raw), REQUEST)
    kept = anthropic_shape.message(raw, {**REQUEST, "kv_transfer_params": {"do_remote_decode": True}})
    assert kept["kv_transfer_params"] == {"remote": 1}


def test_shaping_twice_changes_nothing_more():
    once = anthropic_shape.message(vllm_message(), REQUEST)
    assert anthropic_shape.message(copy.deepcopy(once), REQUEST) == once


# --- stream ---------------------------------------------------------------------------------


def chunk(delta=None, finish_reason=None, usage=None):
    """A chat stream frame as vLLM's chat generator yields it (``exclude_unset``)."""
    choices = [ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=finish_reason)] if delta else []
    response = ChatCompletionStreamResponse(id="chatcmpl-abc123", model="m", choices=choices, usage=usage)
    return f"data: {response.model_dump_json(exclude_unset=True)}\n\n"


def vllm_stream(chat_frames):
    """The SSE frames vLLM's ``message_stream_converter`` makes of a chat stream."""

    async def chat():
        for frame in chat_frames:
            yield frame

    async def collect():
        return [frame async for frame in AnthropicServingMessages.message_stream_converter(None, chat())]

    return asyncio.run(collect())


def full_stream():
    opening = DeltaFunctionCall(name="get_weather", arguments='{"city":')
    call = DeltaToolCall(index=0, id="call_1", type="function", function=opening)
    rest = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=' "SF"}'))
    return vllm_stream(
        [
            chunk(DeltaMessage(role="assistant", content=""), usage=UsageInfo(prompt_tokens=10, total_tokens=10)),
            chunk(DeltaMessage(reasoning="SF weather")),
            chunk(DeltaMessage(content="Let me check.")),
            chunk(DeltaMessage(tool_calls=[call])),
            chunk(DeltaMessage(tool_calls=[rest]), finish_reason="tool_calls"),
            chunk(usage=UsageInfo(prompt_tokens=10, completion_tokens=5, total_tokens=15)),
            "data: [DONE]\n\n",
        ]
    )


def parse(frame):
    name, _, data = frame.partition("\ndata: ")
    assert name.startswith("event: ") and frame.endswith("\n\n")
    return name[len("event: ") :], json.loads(data)


def component(name):
    return "ErrorResponse" if name == "error" else "MessageStreamEvent"


STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)


def test_every_vllm_stream_frame_validates_once_shaped():
    frames = full_stream()
    kinds = [parse(frame)[0] for frame in frames]
    assert set(kinds) == {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    }
    failing = set()
    for frame in frames:
        name, data = parse(frame)
        if errors("anthropic", component(name), data):
            failing.add(name)
        out_name, out = parse(anthropic_shape.stream_event(frame, REQUEST))
        assert out_name == name == out["type"]
        validate("anthropic", component(name), out)
        STREAM_EVENT.validate_python(out)  # and the SDK reads it
    assert failing == {"message_start", "content_block_start", "message_delta"}


def test_each_block_start_gets_what_its_kind_requires():
    frames = [f for f in full_stream() if f.startswith("event: content_block_start")]
    starts = [parse(anthropic_shape.stream_event(frame, REQUEST))[1] for frame in frames]
    assert [start["content_block"] for start in starts] == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "", "citations": None},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}, "caller": {"type": "direct"}},
    ]


def test_message_start_and_delta_get_the_message_fixes():
    frames = [anthropic_shape.stream_event(frame, REQUEST) for frame in full_stream()]
    (start,) = [parse(f)[1] for f in frames if f.startswith("event: message_start")]
    (delta,) = [parse(f)[1] for f in frames if f.startswith("event: message_delta")]
    assert start["message"]["id"] == "msg_abc123" and start["message"]["container"] is None
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None, "container": None, "stop_details": None}
    assert delta["usage"]["output_tokens"] == 5 and delta["usage"]["cache_read_input_tokens"] is None


def test_deltas_stops_and_pings_come_back_as_the_same_string():
    kinds = ("event: content_block_delta", "event: content_block_stop", "event: message_stop")
    unchanged = [frame for frame in full_stream() if frame.startswith(kinds)]
    assert {parse(f)[1]["delta"]["type"] for f in unchanged if "_delta" in f.split("\n")[0]} == {
        "thinking_delta",
        "signature_delta",
        "text_delta",
        "input_json_delta",
    }
    for frame in [*unchanged, "event: ping\ndata: {\"type\": \"ping\"}\n\n"]:
        assert anthropic_shape.stream_event(frame, REQUEST) is frame


def test_a_delta_is_not_parsed():
    frame = "event: content_block_delta\ndata: {not json\n\n"
    assert anthropic_shape.stream_event(frame, REQUEST) is frame


def test_vllm_stream_error_gets_an_anthropic_type_and_keeps_its_message():
    # vLLM's converter cannot read the chat stream's error chunk and reports its own failure.
    frames = vllm_stream(['data: {"error": {"message": "boom", "type": "BadRequestError", "code": 400}}\n\n'])
    (frame,) = frames
    name, data = parse(frame)
    assert name == "error" and data["error"]["type"] == "internal_error"
    assert errors("anthropic", "ErrorResponse", data)
    _, out = parse(anthropic_shape.stream_event(frame, REQUEST))
    assert out["error"]["type"] == "api_error" and out["error"]["message"] == data["error"]["message"]
    assert out["request_id"] is None
    validate("anthropic", "ErrorResponse", out)


@pytest.mark.parametrize(
    "error, kind",
    [
        ({"type": "overloaded_error", "message": "busy"}, "overloaded_error"),  # already Anthropic's
        ({"type": "BadRequestError", "message": "bad"}, "invalid_request_error"),
        ({"type": "whatever", "message": "x", "code": 429}, "rate_limit_error"),
    ],
)
def test_error_event_types(error, kind):
    frame = f"event: error\ndata: {json.dumps({'type': 'error', 'error': error})}\n\n"
    _, out = parse(anthropic_shape.stream_event(frame, REQUEST))
    assert out["error"] == {"type": kind, "message": error["message"]}
    validate("anthropic", "ErrorResponse", out)


# --- errors ---------------------------------------------------------------------------------


def spec_error_types():
    document = _document("anthropic")["components"]
    branches = document["ErrorResponse"]["properties"]["error"]["oneOf"]
    return {document[b["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["const"] for b in branches}


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (402, "billing_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "invalid_request_error"),  # the spec's enum has no request_too_large
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (501, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_type_by_status(status, kind):
    assert anthropic_shape.error_type(status) == kind
    body = anthropic_shape.error_body(status, "it went wrong")
    assert body == {"type": "error", "error": {"type": kind, "message": "it went wrong"}, "request_id": None}
    validate("anthropic", "ErrorResponse", body)


def test_error_types_are_exactly_the_spec_enum():
    assert anthropic_shape.ERROR_TYPES == spec_error_types()


def test_error_body_carries_a_request_id_when_given():
    body = anthropic_shape.error_body(404, "no such model", request_id="req_1")
    assert body["request_id"] == "req_1"
    validate("anthropic", "ErrorResponse", body)
