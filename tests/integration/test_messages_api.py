"""Anthropic's Messages API end to end, through the official anthropic SDK: create, stream,
tools, thinking, count_tokens, the x-api-key header and Anthropic-shaped errors; every body
checked against the published Anthropic schema."""

import anthropic
import httpx
import pytest

from tests.schema_validation import validate
from tests.sse import named_events

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
ALIAS = "qwen-3.6-a3b"
HI = [{"role": "user", "content": "Say hi in one short sentence."}]
# Tests that assert an answer has text ask for it greedy (a sampled tiny-model answer is empty
# now and then). The SDK has no temperature parameter; vLLM's Messages request takes one.
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def claude(base_url, dev_key) -> anthropic.Anthropic:
    # The SDK sends the key as x-api-key, as it does to Anthropic.
    return anthropic.Anthropic(base_url=base_url, api_key=dev_key, max_retries=0, timeout=120)


def test_create_under_an_alias_is_schema_exact(claude):
    raw = claude.messages.with_raw_response.create(model=ALIAS, max_tokens=16, messages=HI)
    body = raw.http_response.json()
    assert body.pop("pg_metadata")["server_ms"] > 0  # our one extension field (docs/api.md)
    validate("anthropic", "Message", body)
    message = raw.parse()
    assert message.model == MODEL and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"], message
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 16


def test_stream_events_follow_anthropic_order_and_schema(base_url, dev_key):
    body = {"model": MODEL, "max_tokens": 12, "messages": HI, "stream": True}
    headers = {"x-api-key": dev_key, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{base_url}/v1/messages", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert "[DONE]" not in text
    events = named_events(httpx.Response(200, text=text))
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"  # the terminal event last
    assert names.count("message_stop") == 1 and "pg_metadata" not in names
    assert "content_block_delta" in names and "message_delta" in names
    for name, data in events:
        assert data["type"] == name
        validate("anthropic", "MessageStreamEvent", data)
    assert events[-1][1]["pg_metadata"]["inference_total_ms"] is not None  # a field of message_stop


def test_sdk_stream_helper_gives_text_and_the_final_message(claude):
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=HI, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.usage.output_tokens > 0
    # The helper rebuilds message_stop without extra fields; the raw events keep the timing.
    raw = list(claude.messages.create(model=MODEL, max_tokens=12, messages=HI, stream=True))
    assert raw[-1].type == "message_stop" and raw[-1].model_extra["pg_metadata"]["server_ms"] > 0


def test_a_forced_tool_comes_back_as_a_tool_use_block(claude):
    message = claude.messages.create(
        model=MODEL, max_tokens=256, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
    )
    blocks = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and blocks
    assert blocks[0].name == "get_weather" and isinstance(blocks[0].input, dict)
    # The result goes back as a tool_result block.
    reply = claude.messages.create(
        model=MODEL, max_tokens=8, tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [block.model_dump() for block in message.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[0].id, "content": "sunny"}]},
        ],
        **GREEDY,
    )
    assert reply.content


def test_thinking_is_opt_in(claude):
    plain = claude.messages.create(model=MODEL, max_tokens=16, messages=HI)
    assert all(block.type != "thinking" for block in plain.content)
    thought = claude.messages.create(
        model=MODEL, max_tokens=2048, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert thought.content[0].type == "thinking" and thought.content[0].thinking


def test_count_tokens_matches_what_create_charges(claude):
    raw = claude.messages.with_raw_response.count_tokens(model=MODEL, messages=HI)
    body = raw.http_response.json()
    body.pop("pg_metadata")
    validate("anthropic", "CountMessageTokensResponse", body)
    counted = raw.parse()
    created = claude.messages.create(model=MODEL, max_tokens=4, messages=HI)
    assert counted.input_tokens == created.usage.input_tokens > 0


def test_bearer_works_too_and_two_credentials_are_refused(base_url, dev_key):
    body = {"model": MODEL, "max_tokens": 4, "messages": HI}
    bearer = httpx.post(f"{base_url}/v1/messages", json=body, headers={"Authorization": f"Bearer {dev_key}"}, timeout=60)
    assert bearer.status_code == 200
    both = httpx.post(
        f"{base_url}/v1/messages", json=body, timeout=60,
        headers={"Authorization": f"Bearer {dev_key}", "x-api-key": dev_key},
    )
    assert both.status_code == 400
    assert both.json()["error"]["type"] == "invalid_request_error"


def test_errors_come_in_anthropic_shape(base_url, claude):
    with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        anthropic.Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=HI
        )
    assert unauthenticated.value.body["type"] == "error"
    assert unauthenticated.value.body["error"]["type"] == "authentication_error"
    # (anthropic 2.14 no longer takes temperature as an argument: clients send it as a body field)
    for bad, extra in (({"max_tokens": 0}, {}), ({"messages": [{"role": "robot", "content": "hi"}]}, {}), ({}, {"temperature": 1.5})):
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(**{"model": MODEL, "max_tokens": 4, "messages": HI, **bad}, extra_body=extra)
        validate("anthropic", "ErrorResponse", err.value.body)
        assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_schema_no_grammar_can_be_made_of_is_a_400_naming_it(claude, stream):
    """vLLM refuses it unreadably ("Invalid grammar specification: 'triggers'"), as the engine
    takes the request: a stream too is refused with the status line, and the message names the
    tool and xgrammar's reason."""
    tools = [{"name": "lookup", "input_schema": {"type": "object", "properties": {"city": {"type": "strin"}}}}]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=8, messages=HI, tools=tools, stream=stream)
    validate("anthropic", "ErrorResponse", err.value.body)
    assert "tools[0].input_schema" in err.value.body["error"]["message"]
    assert "strin" in err.value.body["error"]["message"]

