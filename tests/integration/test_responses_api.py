"""OpenAI's Responses API end to end, through the official openai SDK: stream and non-stream,
tools, JSON output, conversations continued with ``previous_response_id`` (the router's region
store), retrieve / delete / cancel; every body and event checked against the published OpenAI
schema and the Open Responses specification (``validate_responses``), every stream against the
order rules (terminal event last, ``sequence_number`` 0, 1, 2…, no ``[DONE]``)."""

import json

import httpx
import openai
import pytest

from tests.schema_validation import validate_responses
from tests.sse import named_events

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
ALIAS = "qwen-3.6-a3b"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def _spec_body(body: dict) -> dict:
    """The body without our one documented extension field (docs/api.md, "Timing")."""
    assert body["pg_metadata"]["server_ms"] > 0
    return {k: v for k, v in body.items() if k != "pg_metadata"}


def test_non_stream_response_is_schema_exact_under_an_alias(client):
    # Greedy: the tiny model's sampled answer can be empty (no text before its end token; once in a
    # CI run at bfa6f9e, 0 of 40 tries by hand), and an empty one says nothing of the schema.
    raw = client.responses.with_raw_response.create(model=ALIAS, input="Say hi in one short sentence.",
                                                    max_output_tokens=16, temperature=0)
    body = raw.http_response.json()
    validate_responses(_spec_body(body))
    assert body["safety_identifier"] is None and body["prompt_cache_key"] is None  # required, null: not sent
    response = raw.parse()
    assert response.model == MODEL and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 16
    assert raw.http_response.headers["server-timing"]


def test_stream_events_follow_the_order_and_both_schemas(base_url, auth_headers):
    body = {"model": MODEL, "input": "Say hi in one short sentence.", "max_output_tokens": 12, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/responses", json=body, headers=auth_headers, timeout=120) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    assert "[DONE]" not in text  # the Responses API has none
    events = named_events(httpx.Response(200, text=text))
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete") and "pg_metadata" not in names
    assert "response.output_text.delta" in names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for name, data in events:
        assert data["type"] == name
        validate_responses(data, event=True)
    for _, data in events[:2]:
        assert data["response"]["usage"] is None  # required; null until known
    timing = events[-1][1]["response"]["pg_metadata"]  # inside the protocol: the terminal event's response
    assert timing["server_ms"] > 0 and timing["inference_total_ms"] is not None


def test_the_sdk_stream_helper_reads_to_the_final_response_and_its_timing(client):
    # The helper's final response is `response.completed`'s only (a `response.incomplete` is an
    # error to it): greedy decoding, with which the tiny model ends its turn within six tokens.
    with client.responses.stream(model=MODEL, input="Say hi.", max_output_tokens=12, temperature=0,
                                 safety_identifier="user-1234", prompt_cache_key="greeting") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas and final.output_text == "".join(deltas)
    assert final.safety_identifier == "user-1234" and final.prompt_cache_key == "greeting"
    assert final.model_extra["pg_metadata"]["server_ms"] > 0
    kept = client.responses.retrieve(final.id)
    assert kept.output_text == final.output_text and "pg_metadata" not in (kept.model_extra or {})


def test_sdk_stream_yields_text_and_a_final_response(client):
    stream = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=12, stream=True)
    deltas, final = [], None
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert deltas and final is not None
    assert final.output_text == "".join(deltas)


def test_a_required_tool_call_comes_back_as_a_function_call_item(client):
    response = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=256
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments), dict)


def test_json_schema_output(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Answer in JSON.", max_output_tokens=256,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    assert isinstance(json.loads(response.output_text)["ok"], bool)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8)
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8)
    # The engine saw the first turn (the user's message and the answer) before the new input.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    third = client.responses.create(model=MODEL, input="And again?", previous_response_id=second.id, max_output_tokens=8)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_a_tool_result_continues_from_the_call(client):
    first = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=256
    )
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
    )
    assert second.status in ("completed", "incomplete")


def test_stored_responses_are_retrieved_and_deleted(client):
    created = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8)
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    with pytest.raises(openai.BadRequestError) as cancelled:
        client.responses.cancel(created.id)
    assert cancelled.value.body["code"] == "response_not_cancellable"
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="x", previous_response_id=created.id, max_output_tokens=4)
    assert missing.value.body["param"] == "previous_response_id"


def test_a_streamed_response_is_stored_too(client):
    stream = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, stream=True)
    final = [event.response for event in stream if event.type in ("response.completed", "response.incomplete")][-1]
    assert client.responses.retrieve(final.id).id == final.id


def test_store_false_keeps_nothing(client):
    created = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, store=False)
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": MODEL, "input": "hi", **extra})
    assert err.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_engine_refuses_is_400_also_for_a_stream(client, stream):
    """vLLM raises a Responses stream's refusal after its ``response.created`` and
    ``.in_progress`` events; the replica runs the stream that far before its head, so the client
    gets a 400, not those two events and then a server error."""
    bad = {"format": {"type": "json_schema", "name": "bad", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=8, text=bad, stream=stream)
    assert err.value.body["type"] == "invalid_request_error" and "no-such-type" in err.value.body["message"]
