"""Strict body validation at the router: the failing field in ``param``, no coercion, deep JSON."""

import json

import pytest

from serve_app.errors import APIError
from serve_app.router.request_schema import MAX_JSON_DEPTH, parse_json_object, validate_body

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": "m", "messages": MESSAGES, **fields}


def refusal(method: str, body: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        validate_body(method, body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (chat(max_tokens="10"), "max_tokens"),
        (chat(stream="yes"), "stream"),
        (chat(logprobs="true"), "logprobs"),
        (chat(messages=None), "messages"),
        (chat(messages=[]), "messages"),
        (chat(presence_penalty=100), "presence_penalty"),
        (chat(frequency_penalty=-3), "frequency_penalty"),
        (chat(top_k=-5), "top_k"),
        (chat(n=-1), "n"),
        (chat(n=129), "n"),
        (chat(n=True), "n"),  # a bool is not an int here
        (chat(temperature=2.5), "temperature"),
        (chat(top_p=1.5), "top_p"),
        (chat(top_logprobs=21), "top_logprobs"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(stop=[1]), "stop[0]"),
        (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0]"),
        (chat(messages=[{"role": "user"}]), "messages[0]"),
        (chat(messages=[{"role": "tool", "content": "42"}]), "messages[0]"),
        (chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
        (chat(tool_choice="sometimes"), "tool_choice"),
        (chat(tool_choice={"type": "function", "function": {}}), "tool_choice.function.name"),
        (chat(response_format={"type": "yaml"}), "response_format.type"),
        (chat(response_format={"type": "json_schema"}), "response_format.json_schema"),  # the field to add
        (chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        (chat(logit_bias={"42": 500}), "logit_bias"),
        ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
        ({"model": "m", "prompt": [["a"]]}, "prompt[0][0]"),
        # No empty prompt (vLLM would be given none) and no negative token id (as embeddings').
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [[1], []]}, "prompt"),
        ({"model": "m", "prompt": [-1]}, "prompt[0]"),
        ({"model": "m", "prompt": [[1], [-2]]}, "prompt[0]"),
        ({"model": "m"}, "prompt"),
    ],
)
def test_bad_fields_are_400_with_their_path_in_param(body, param):
    error = refusal("completions" if "prompt" in body or "messages" not in body else "chat", body)
    assert error.param == param
    assert "invalid request" in error.message


def test_every_problem_is_listed_not_only_the_first():
    error = refusal("chat", chat(max_tokens="10", stream="yes", logprobs="true"))
    for field in ("max_tokens", "stream", "logprobs"):
        assert f"{field}:" in error.message


@pytest.mark.parametrize(
    "body",
    [
        chat(),
        chat(max_tokens=16, temperature=0, top_p=1, n=128, seed=-1, stop=["\n"], stream=True,
             stream_options={"include_usage": True}, logprobs=True, top_logprobs=5, top_k=-1, min_p=0.1,
             repetition_penalty=1.1, ignore_eos=True, enable_thinking=False, logit_bias={"42": -100}),
        chat(messages=[
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]),
        chat(tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
             tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
        chat(some_vllm_extra={"kept": True}),  # not ours to refuse: vLLM checks its own extras
        {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True, "logprobs": 2},
        {"model": "m", "prompt": ["a", "b"]},
    ],
)
def test_valid_bodies_pass(body):
    validate_body("completions" if "prompt" in body else "chat", body)


def test_very_deep_json_is_invalid_json_without_a_recursion_error():
    raw = b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    with pytest.raises(APIError) as caught:
        parse_json_object(raw)
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


def test_nesting_just_past_the_limit_is_refused_and_at_it_passes():
    def nested(depth: int) -> bytes:
        return json.dumps({"a": json.loads("[" * (depth - 1) + "]" * (depth - 1))}).encode()

    assert parse_json_object(nested(MAX_JSON_DEPTH))
    with pytest.raises(APIError) as caught:
        parse_json_object(nested(MAX_JSON_DEPTH + 1))
    assert caught.value.code == "invalid_json"


# --- fields the server owns, and OpenAI's metadata limits (issue 22: stored responses) ---------------
MINIMAL = {
    "chat": chat(),
    "completions": {"model": "m", "prompt": "x"},
    "tokenize": {"model": "m", "prompt": "x"},
    "detokenize": {"model": "m", "tokens": [1]},
    "responses": {"model": "m", "input": "hi"},
    "messages": {"model": "m", "max_tokens": 8, "messages": MESSAGES},
    "count_tokens": {"model": "m", "messages": MESSAGES},
}


@pytest.mark.parametrize("method", sorted(MINIMAL))
@pytest.mark.parametrize("request_id", ["resp_0123456789abcdef", None, 7])
def test_a_client_request_id_is_refused_on_every_route(method, request_id):
    # vLLM takes it as the engine's request id, and a stored Response's id is that id: owner B
    # sending A's id would make B's response collide with A's.
    validate_body(method, MINIMAL[method])
    error = refusal(method, {**MINIMAL[method], "request_id": request_id})
    assert error.param == "request_id" and "made by the server" in error.message


def responses(**fields):
    return {"model": "m", "input": "hi", **fields}


@pytest.mark.parametrize("method, body", [("responses", responses()), ("chat", chat())])
def test_metadata_keeps_openais_limits(method, body):
    at_limits = {f"k{i:02d}".ljust(64, "x"): "v" * 512 for i in range(16)}
    validate_body(method, {**body, "metadata": at_limits})
    validate_body(method, {**body, "metadata": {"ключ": "é" * 512}})  # characters, not bytes
    cases = [
        ({"k": "x" * (938 * 1024)}, "at most 512"),  # the 938 KiB stored for 19 billed tokens
        ({"k": "x" * 513}, "at most 512"),
        ({"k" * 65: "v"}, "at most 64"),
        ({f"k{i}": "v" for i in range(17)}, "at most 16"),
        ({"k": "\ud800"}, "lone surrogate"),
        ({"\udfff": "v"}, "lone surrogate"),
        ({"k": 1}, None),
    ]
    for metadata, fragment in cases:
        error = refusal(method, {**body, "metadata": metadata})
        assert error.param == "metadata" and (fragment is None or fragment in error.message), error.message


def test_anthropic_metadata_user_id_keeps_anthropics_limit():
    body = MINIMAL["messages"]
    validate_body("messages", {**body, "metadata": {"user_id": "u" * 256}})
    assert refusal("messages", {**body, "metadata": {"user_id": "u" * 257}}).param == "metadata.user_id"
    assert refusal("messages", {**body, "metadata": {"user_id": "u", "note": "x" * 10_000}}).param == "metadata"
