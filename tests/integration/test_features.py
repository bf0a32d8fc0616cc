"""Every row of the model card's Capabilities table, end to end through the official openai SDK.

The tiny model's weights are random, so tests assert structure (valid JSON, schema conformance,
finish reasons, determinism), never wording. Constrained decoding makes structure hold anyway.
"""

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
ASK = [{"role": "user", "content": "What's the weather in Tokyo?"}]

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

CAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age_years": {"type": "integer"},
        "color": {"type": "string"},
    },
    "required": ["name", "age_years", "color"],
}


def assert_valid_call(call, name=None):
    assert call.type == "function"
    assert call.id
    if name:
        assert call.function.name == name
    assert call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# --- function calling -------------------------------------------------------------------------


# With parallel calls allowed, random weights may keep opening <tool_call> blocks until
# max_tokens (a real model stops); one call per turn keeps these tests about structure.
ONE_CALL = {"tool_choice": "required", "parallel_tool_calls": False}
# Tests that assert an answer has text ask for it greedy: a sampled tiny-model answer is empty
# now and then (1 in 30 of 8 tokens, measured), the greedy one the same every time.
GREEDY = {"temperature": 0}


def test_tool_choice_required_returns_schema_valid_calls(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, **ONE_CALL
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call)


def test_named_tool_choice_forces_that_tool(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert_valid_call(call, name="get_time")


def test_tool_choice_none_answers_in_text(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, **GREEDY
    )
    message = reply.choices[0].message
    assert not message.tool_calls
    assert message.content


def test_tool_choice_auto_gives_text_or_valid_calls(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=64, seed=3
    )
    choice = reply.choices[0]
    assert choice.finish_reason in {"stop", "length", "tool_calls"}
    for call in choice.message.tool_calls or []:
        assert_valid_call(call)
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls


def test_streamed_tool_call_deltas_assemble_into_schema_valid_json(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, stream=True, **ONE_CALL
    )
    calls: dict[int, dict] = {}
    finish_reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function and delta.function.name:
                    call["name"] += delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert finish_reasons == ["tool_calls"]
    assert calls
    for call in calls.values():
        assert call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_results_round_trip_into_the_next_turn(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, **ONE_CALL
    )
    assistant = first.choices[0].message
    messages = [
        *ASK,
        assistant.model_dump(exclude_none=True),
        *(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}
            for call in assistant.tool_calls
        ),
    ]
    follow_up = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, **GREEDY
    )
    assert follow_up.choices[0].message.content
    assert follow_up.usage.prompt_tokens > first.usage.prompt_tokens


def test_named_tool_that_is_not_in_tools_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "launch_rocket"}},
            max_tokens=8,
        )
    assert err.value.body["param"] == "tool_choice"


# --- structured output ------------------------------------------------------------------------


def test_json_object_output_parses(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("strict", [False, True])
def test_json_schema_output_validates(client, strict):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "cat", "schema": CAT_SCHEMA, "strict": strict},
        },
        max_tokens=200,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), CAT_SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_json_schema_is_400(client, stream):
    """xgrammar refuses the schema as the engine takes the request: a stream too is refused with
    the status line, before any event (the openai SDK raises at create, as OpenAI's API does)."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}},
            },
            max_tokens=8,
            stream=stream,
        )
    assert "no-such-type" in err.value.body["message"]
    assert err.value.body["param"] == "response_format.json_schema.schema"  # vLLM names none


def test_a_regex_no_grammar_can_be_made_of_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                       extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert err.value.body["param"] == "structured_outputs.regex" and "regex" in err.value.body["message"]


@pytest.mark.parametrize("prompt, refused", [
    ([[1, 2, 3], [1, 99_999_999]], "prompt[1][1]"),  # an id past the tokenizer: named by the replica
    (["Hello", "there"], "no-such-type"),  # a schema xgrammar refuses, for both prompts
])
def test_a_completions_stream_of_several_prompts_refused_by_the_engine_is_400(client, prompt, refused):
    """vLLM merges the prompts' engine requests before one is refused: the stream still gets the
    status line a non-stream request gets, not a 200 and an error event."""
    schema = {"type": "no-such-type"} if refused == "no-such-type" else {"type": "object"}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=4, stream=True,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
        )
    assert refused in (err.value.body["param"] or "") + err.value.body["message"]


# --- sampling ---------------------------------------------------------------------------------


def test_every_sampling_control_is_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0.7,
        top_p=0.9,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        seed=11,
        stop=["\n\n"],
        max_completion_tokens=6,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert 0 < reply.usage.completion_tokens <= 6


def test_same_seed_and_params_give_the_same_output(client):
    params = dict(model=MODEL, messages=ASK, temperature=1.0, seed=1234, max_tokens=16)
    first = client.chat.completions.create(**params).choices[0].message.content
    second = client.chat.completions.create(**params).choices[0].message.content
    assert first == second
    other = client.chat.completions.create(**{**params, "seed": 4321}).choices[0].message.content
    assert other != first


def test_stream_text_equals_non_stream_text_for_the_same_seed(client):
    params = dict(model=MODEL, messages=ASK, temperature=1.0, seed=77, max_tokens=24)
    whole = client.chat.completions.create(**params).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**params, stream=True)
        if chunk.choices
    )
    assert streamed == whole


def test_stop_string_ends_generation_before_it(client):
    # The tiny model's output prior makes '"' its most likely token, so greedy output meets it.
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, stop=['"'], max_tokens=50
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert '"' not in (choice.message.content or "")


def test_max_tokens_and_max_completion_tokens_cap_the_output(client):
    for cap in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        # ignore_eos: the tiny model may end its turn within 3 sampled tokens (tiny_model.py)
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=1.0, extra_body={"ignore_eos": True}, **cap
        )
        assert reply.usage.completion_tokens == 3
        assert reply.choices[0].finish_reason == "length"


def test_n_returns_that_many_choices_each_with_one_finish_reason(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, n=2, temperature=1.0, max_tokens=4
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, n=2, temperature=1.0, max_tokens=4, stream=True
    )
    finishes: dict[int, int] = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index] = finishes.get(choice.index, 0) + 1
    assert finishes == {0: 1, 1: 1}


@pytest.mark.parametrize(
    "params, param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"top_k": -7}}, "top_k"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        # vLLM names the sampling field behind top_logprobs: `logprobs`.
        ({"logprobs": True, "top_logprobs": 50}, "logprobs"),
    ],
)
def test_out_of_range_sampling_values_are_400_naming_the_parameter(client, params, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, **{"max_tokens": 4, **params})
    body = err.value.body
    assert param in (body.get("param") or "") or param in body["message"]


# --- reasoning --------------------------------------------------------------------------------


def test_thinking_is_off_by_default(client):
    message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **GREEDY).choices[0].message
    assert message.content
    assert not getattr(message, "reasoning", None)


@pytest.mark.parametrize(
    "switch",
    [{"enable_thinking": True}, {"chat_template_kwargs": {"enable_thinking": True}}],
)
def test_thinking_opt_in_returns_reasoning_separately(client, switch):
    message = (
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, extra_body=switch)
        .choices[0]
        .message
    )
    # Random weights never close </think> within 16 tokens: everything is reasoning, none content.
    assert message.reasoning
    assert not message.content


# --- logprobs ---------------------------------------------------------------------------------


def test_chat_logprobs_and_top_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for token in content:
        assert token.logprob <= 0
        assert len(token.top_logprobs) == 3


def test_completion_logprobs(client):
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 4
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)


# --- context window and body size -------------------------------------------------------------


def _long_text(words: int) -> str:
    return " ".join(["license"] * words)


def test_prompt_over_the_context_cap_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": _long_text(9000)}], max_tokens=4
        )
    body = err.value.body
    assert body["code"] == "context_length_exceeded"
    assert "8192" in body["message"]


def test_prompt_plus_max_tokens_over_the_cap_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": _long_text(4000)}], max_tokens=6000
        )
    body = err.value.body
    assert body["code"] == "context_length_exceeded"
    assert "8192" in body["message"] and "6000" in body["message"]


def test_oversized_body_is_413(base_url, client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    headers = {"Authorization": f"Bearer {client.api_key}"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


# --- completions parity -----------------------------------------------------------------------


def test_completions_sampling_seed_stop_and_n(client):
    params = dict(model=MODEL, prompt="Hello", temperature=1.0, seed=5, max_tokens=8)
    first = client.completions.create(**params).choices[0].text
    assert client.completions.create(**params).choices[0].text == first
    reply = client.completions.create(**{**params, "n": 2})
    assert sorted(c.index for c in reply.choices) == [0, 1]
    stopped = client.completions.create(model=MODEL, prompt="Hello", temperature=0, stop=['"'], max_tokens=50)
    assert '"' not in stopped.choices[0].text


def test_completions_stream_usage_and_text_parity(client):
    params = dict(model=MODEL, prompt="Hello", temperature=1.0, seed=9, max_tokens=10)
    whole = client.completions.create(**params)
    chunks = list(
        client.completions.create(**params, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

