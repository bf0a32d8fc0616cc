"""Every route's bodies and every stream's events, as the real router sends them (on the fake
engine, whose Responses and Messages answers are vLLM's own objects: ``fake_vllm.py``), against
the vendored specifications (tests/data/schemas: OpenAI 2.3.0, Open Responses 2026-04-24,
Anthropic's SDK spec), with the rules on a stream's order that no schema states: the terminal
event last and nothing after it, ``sequence_number`` strictly increasing (Responses), exactly one
``[DONE]`` where the protocol has one (chat, completions) and none where it has none.

Our timing rides inside each protocol (docs/api.md, "Server timing"): a chunk-shaped event before
``[DONE]`` (chat, completions), ``response.pg_metadata`` in the terminal event (Responses),
``pg_metadata`` on ``message_stop`` (Messages), ``pg_metadata`` in a JSON body.
"""

import json

import pytest

from auth_support import DEV_KEY, MODEL
from fake_engine import FakeEngine
from tests.schema_validation import validate, validate_responses

HEADERS = {"Authorization": f"Bearer {DEV_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
MESSAGE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed")
DONE = "data: [DONE]"


def frames(text: str) -> list[tuple[str | None, str]]:
    """Each SSE frame of a stream as (``event:`` name or None, ``data:`` text)."""
    found = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        name = data = None
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
        found.append((name, data))
    return found


def stream(app, route: str, body: dict) -> tuple[list[tuple[str | None, dict]], str]:
    response = app.client.post(route, json={**body, "stream": True}, headers=HEADERS)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [(name, json.loads(data)) for name, data in frames(response.text) if data != "[DONE]"]
    return events, response.text


def without_timing(body: dict) -> dict:
    assert body["pg_metadata"]["server_ms"] > 0 and body["pg_metadata"]["trace_id"]
    return {k: v for k, v in body.items() if k != "pg_metadata"}


@pytest.fixture
def app(router_app):
    return router_app()


# --- chat and completions: unchanged closing, one [DONE] ----------------------------------------


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("route, body, component", [
    ("/v1/chat/completions", CHAT, "CreateChatCompletionStreamResponse"),
    ("/v1/completions", COMPLETION, "CreateCompletionResponse"),
])
def test_chat_and_completions_streams_validate_and_end_with_one_done(app, route, body, component, include_usage):
    sent = {**body, "stream_options": {"include_usage": True}} if include_usage else body
    events, text = stream(app, route, sent)
    assert text.count(DONE) == 1 and text.endswith(DONE + "\n\n")
    for _, data in events:
        if component == "CreateCompletionResponse":
            # The spec has no schema of its own for a completions chunk: it is a whole completion
            # whose finish_reason is null until the last chunk, as OpenAI sends it.
            data = {**data, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in data["choices"]]}
        validate("openai", component, data)
    name, last = events[-1]
    assert name == "pg_metadata" and last["pg_metadata"]["inference_total_ms"] == 5.0
    assert ("usage" in last) is include_usage  # the usage the stream reported, on its last chunk too


@pytest.mark.parametrize("route, body, component", [
    ("/v1/chat/completions", CHAT, "CreateChatCompletionResponse"),
    ("/v1/completions", COMPLETION, "CreateCompletionResponse"),
])
def test_chat_and_completions_bodies_validate(app, route, body, component):
    response = app.client.post(route, json=body, headers=HEADERS)
    assert response.status_code == 200
    validate("openai", component, without_timing(response.json()))


def test_openai_error_bodies_validate(app):
    for route, body in (("/v1/chat/completions", {**CHAT, "max_tokens": 0}), ("/v1/responses", {**RESPONSE, "top_p": 9})):
        refused = app.client.post(route, json=body, headers=HEADERS)
        assert refused.status_code == 400
        validate("openai", "ErrorResponse", refused.json())


# --- Responses ----------------------------------------------------------------------------------


def test_a_responses_stream_ends_with_its_terminal_event_carrying_the_timing(app):
    events, text = stream(app, "/v1/responses", RESPONSE)
    assert DONE not in text  # the Responses API has no [DONE]
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed" and "pg_metadata" not in names
    assert sum(name in RESPONSES_TERMINAL for name in names) == 1
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events)))  # monotonic, none skipped, none repeated
    for name, data in events:
        assert data["type"] == name
        validate_responses(data, event=True)
    timing = events[-1][1]["response"]["pg_metadata"]
    assert timing["inference_total_ms"] == 5.0 and timing["server_ms"] > 0 and timing["trace_id"]


def test_response_objects_carry_usage_and_the_two_identifiers_null_until_known(app):
    events, _ = stream(app, "/v1/responses", RESPONSE)
    for name, data in events[:2]:
        response = data["response"]
        assert response["usage"] is None  # required; null until the end
        assert response["safety_identifier"] is None and response["prompt_cache_key"] is None
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 4


def test_the_two_identifiers_are_echoed_in_every_response_object(app):
    sent = {**RESPONSE, "safety_identifier": "user-1234", "prompt_cache_key": "faq-v2"}
    events, _ = stream(app, "/v1/responses", sent)
    objects = [data["response"] for _, data in events if "response" in data]
    whole = app.client.post("/v1/responses", json=sent, headers=HEADERS).json()
    for response in [*objects, whole]:
        assert response["safety_identifier"] == "user-1234" and response["prompt_cache_key"] == "faq-v2"
    # Echoed, never a prefix-cache partition: the engine got the owner's salt, not the client's key.
    _, body = app.engine.bodies[-1]
    assert body["prompt_cache_key"] == "faq-v2" and app.engine.calls[-1][1].cache_salt != "faq-v2"


def test_the_two_identifiers_are_typed(app):
    for field, value in (("safety_identifier", 7), ("safety_identifier", "x" * 65), ("prompt_cache_key", ["a"])):
        refused = app.client.post("/v1/responses", json={**RESPONSE, field: value}, headers=HEADERS)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_a_cut_response_stream_ends_with_response_incomplete(router_app):
    app = router_app(engine=FakeEngine(tokens=6))
    events, _ = stream(app, "/v1/responses", {**RESPONSE, "max_output_tokens": 2})
    name, last = events[-1]
    assert name == "response.incomplete" and last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "pg_metadata" in last["response"]
    validate_responses(last, event=True)


def test_responses_bodies_validate_and_the_stored_one_has_no_timing(app):
    created = app.client.post("/v1/responses", json=RESPONSE, headers=HEADERS)
    assert created.status_code == 200
    body = created.json()
    validate_responses(without_timing(body))
    kept = app.client.get(f"/v1/responses/{body['id']}", headers=HEADERS)
    assert kept.status_code == 200 and "pg_metadata" not in kept.json()
    validate_responses(kept.json())


def test_a_streamed_response_is_stored_as_its_terminal_event_had_it_without_timing(app):
    events, _ = stream(app, "/v1/responses", RESPONSE)
    final = events[-1][1]["response"]
    kept = app.client.get(f"/v1/responses/{final['id']}", headers=HEADERS)
    assert kept.status_code == 200
    assert kept.json() == {k: v for k, v in final.items() if k != "pg_metadata"}
    follow = app.client.post("/v1/responses", json={**RESPONSE, "previous_response_id": final["id"]}, headers=HEADERS)
    assert follow.status_code == 200 and follow.json()["previous_response_id"] == final["id"]


def test_a_continued_stream_echoes_the_id_it_continued_and_the_store_flag(app):
    first = app.client.post("/v1/responses", json=RESPONSE, headers=HEADERS).json()
    events, _ = stream(app, "/v1/responses", {**RESPONSE, "previous_response_id": first["id"], "store": True})
    for _, data in events:
        if "response" in data:
            assert data["response"]["previous_response_id"] == first["id"] and data["response"]["store"] is True


# --- Messages -----------------------------------------------------------------------------------


def test_a_messages_stream_ends_with_message_stop_carrying_the_timing(app):
    events, text = stream(app, "/v1/messages", MESSAGE)
    assert DONE not in text
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.count("message_stop") == 1 and "pg_metadata" not in names
    for name, data in events:
        assert data["type"] == name
        validate("anthropic", "MessageStreamEvent", data)
    timing = events[-1][1]["pg_metadata"]
    assert timing["inference_total_ms"] == 5.0 and timing["server_ms"] > 0


def test_messages_bodies_validate(app):
    message = app.client.post("/v1/messages", json=MESSAGE, headers=HEADERS)
    assert message.status_code == 200
    validate("anthropic", "Message", without_timing(message.json()))
    counted = app.client.post("/v1/messages/count_tokens", json={k: v for k, v in MESSAGE.items() if k != "max_tokens"},
                              headers=HEADERS)
    assert counted.status_code == 200
    validate("anthropic", "CountMessageTokensResponse", without_timing(counted.json()))
    refused = app.client.post("/v1/messages", json={**MESSAGE, "max_tokens": 0}, headers=HEADERS)
    assert refused.status_code == 400
    validate("anthropic", "ErrorResponse", refused.json())


# --- a stream the engine did not finish ---------------------------------------------------------


@pytest.mark.parametrize("route, body", [("/v1/responses", RESPONSE), ("/v1/messages", MESSAGE)])
def test_a_stream_whose_engine_died_ends_with_an_error_event_and_no_terminal_event(router_app, route, body):
    app = router_app(engine=FakeEngine(tokens=4, fail_after=2, dies=True))
    events, text = stream(app, route, body)
    assert DONE not in text
    name, last = events[-1]
    assert name == "error" and last["type"] == "error"
    names = [name for name, _ in events]
    assert not set(names) & {*RESPONSES_TERMINAL, "message_stop", "pg_metadata"}
    if route == "/v1/messages":
        validate("anthropic", "ErrorResponse", last)
    else:
        assert last["code"] == last["error"]["code"]  # both specs' shapes in one event
        assert last["message"] == last["error"]["message"]


def test_a_dead_engines_responses_error_event_continues_the_numbering(router_app):
    app = router_app(engine=FakeEngine(tokens=4, fail_after=2, dies=True))
    events, _ = stream(app, "/v1/responses", RESPONSE)
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events)))
    validate_responses(events[-1][1], event=True)


# --- the official SDKs' stream helpers, to their final objects -----------------------------------


def test_the_openai_sdk_reads_a_responses_stream_to_its_final_response_with_the_timing(app):
    import openai

    client = openai.OpenAI(api_key=DEV_KEY, base_url="http://testserver/v1", http_client=app.client, max_retries=0)
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=4) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and "pg_metadata" not in kinds
    assert final.output_text == "t1 t2 t3 t4 " and final.usage.output_tokens == 4
    assert final.safety_identifier is None and final.prompt_cache_key is None
    assert final.model_extra["pg_metadata"]["inference_total_ms"] == 5.0  # the timing, inside the protocol
    created = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, safety_identifier="u-1")
    assert created.safety_identifier == "u-1" and created.model_extra["pg_metadata"]["server_ms"] > 0


def test_the_anthropic_sdk_reads_a_messages_stream_to_its_final_message_and_its_raw_events_the_timing(app):
    import anthropic

    client = anthropic.Anthropic(api_key=DEV_KEY, base_url="http://testserver", http_client=app.client, max_retries=0)
    with client.messages.stream(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[-1] == "message_stop" and "pg_metadata" not in kinds
    assert final.content[0].text == "t1 t2 t3 " and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 3
    # The helper rebuilds message_stop (its own event, without extra fields); the raw events keep
    # the timing (docs/api.md, "Server timing").
    raw = list(client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                      stream=True))
    assert raw[-1].type == "message_stop" and raw[-1].model_extra["pg_metadata"]["inference_total_ms"] == 5.0
