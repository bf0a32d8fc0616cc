"""Chat and completions bodies, non-stream and every stream chunk, against the published OpenAI
schema (tests/data/schemas): no ``null`` where the spec wants an object, array or enum, and none
of vLLM's own fields unless asked for; every stream ends with exactly one ``[DONE]``, after the
timing chunk. Our one extension, ``pg_metadata``, is checked apart."""

import httpx
import pytest

from tests.schema_validation import validate
from tests.sse import named_events

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
ASK = [{"role": "user", "content": "Say hi in one short sentence."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
VLLM_ONLY = ("token_ids", "stop_reason", "prompt_token_ids", "prompt_text", "prompt_logprobs", "kv_transfer_params")

CHAT_BODIES = {
    "plain": {"messages": ASK, "max_tokens": 8},
    "tools": {"messages": ASK, "max_tokens": 200, "tools": [WEATHER], "tool_choice": "required"},
    "logprobs": {"messages": ASK, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
    "json": {"messages": ASK, "max_tokens": 64, "response_format": {"type": "json_object"}},
    "thinking": {"messages": ASK, "max_tokens": 8, "enable_thinking": True},
}


def _without_extension(body: dict) -> dict:
    assert body.pop("pg_metadata")["server_ms"] > 0
    return body


def _stream(url: str, body: dict, headers: dict) -> list[tuple[str | None, dict]]:
    """The stream's events; it must end with exactly one ``[DONE]``, its last line."""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert text.count("data: [DONE]") == 1 and text.endswith("data: [DONE]\n\n")
    return named_events(httpx.Response(200, text=text))


def _no_vllm_fields(body: dict) -> None:
    for level in (body, *(body.get("choices") or [])):
        assert not set(VLLM_ONLY) & set(level), level


@pytest.mark.parametrize("kind", CHAT_BODIES)
def test_chat_bodies_and_chunks_validate(base_url, auth_headers, kind):
    request = {"model": MODEL, **CHAT_BODIES[kind]}
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=request, headers=auth_headers, timeout=120)
    assert reply.status_code == 200
    body = _without_extension(reply.json())
    validate("openai", "CreateChatCompletionResponse", body)
    _no_vllm_fields(body)
    stream = {**request, "stream": True, "stream_options": {"include_usage": True}}
    events = _stream(f"{base_url}/v1/chat/completions", stream, auth_headers)
    assert events[-1][0] == "pg_metadata"
    for _, chunk in events[:-1] + [(None, _without_extension(events[-1][1]))]:
        validate("openai", "CreateChatCompletionStreamResponse", chunk)
        _no_vllm_fields(chunk)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"echo": True}])
def test_completions_bodies_and_chunks_validate(base_url, auth_headers, extra):
    request = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, **extra}
    reply = httpx.post(f"{base_url}/v1/completions", json=request, headers=auth_headers, timeout=120)
    assert reply.status_code == 200
    body = _without_extension(reply.json())
    validate("openai", "CreateCompletionResponse", body)
    _no_vllm_fields(body)
    events = _stream(f"{base_url}/v1/completions", {**request, "stream": True}, auth_headers)
    assert events[-1][0] == "pg_metadata"
    # The spec has no schema of its own for a completions chunk: it is a CreateCompletionResponse
    # (object "text_completion") whose finish_reason is null until the last one, as OpenAI sends it.
    for _, chunk in events[:-1] + [(None, _without_extension(events[-1][1]))]:
        _no_vllm_fields(chunk)
        for choice in chunk["choices"]:
            if choice["finish_reason"] is None:
                choice["finish_reason"] = "stop"
        validate("openai", "CreateCompletionResponse", chunk)


def test_vllm_fields_come_back_when_asked(base_url, auth_headers):
    request = {"model": MODEL, "messages": ASK, "max_tokens": 4, "return_token_ids": True}
    body = httpx.post(f"{base_url}/v1/chat/completions", json=request, headers=auth_headers, timeout=120).json()
    assert len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"]
