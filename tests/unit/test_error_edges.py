"""A client's mistakes at the edges of the request path, each a 4xx in its route's own shape and
nothing lost — found by a bad-input review against the running service (2026-12-06): the real
router on a fake engine (``router_app.py``)."""

import json

import pytest
from starlette.requests import Request

from auth_support import MODEL, bearer
from fake_engine import FakeEngine
from serve_app import surfaces
from serve_app.router import pipeline
from serve_app.router.pricing import MAX_SEQUENCES


@pytest.fixture
def app(router_app):
    return router_app(engine=FakeEngine())


@pytest.fixture
def key(app):
    return app.auth.keys.create_key(owner="alice", tier="standard")[0]


def _anthropic(key: str) -> dict[str, str]:
    return {"x-api-key": key, "anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/messages", 405),
    ("GET", "/v1/messages/count_tokens", 405),
    ("POST", "/v1/messages/nope", 404),
])
def test_anthropics_routes_answer_a_wrong_method_or_path_in_anthropics_shape(app, key, method, path, status):
    response = app.client.request(method, path, headers=_anthropic(key))
    body = response.json()
    assert response.status_code == status
    assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert "param" not in body["error"]


def test_openais_routes_keep_openais_shape(app, key):
    response = app.client.get("/v1/chat/completions", headers=bearer(key))
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("method, path, dialect", [
    ("POST", "/v1/chat/completions/", "openai"),
    ("GET", "/v1/responses/resp_x/", "openai"),
    ("GET", "/health/", "openai"),
    ("POST", "/v1/messages/", "anthropic"),
])
def test_a_trailing_slash_is_a_404_naming_the_route_not_a_redirect_without_credentials(app, key, method, path,
                                                                                        dialect):
    # Starlette's redirect would be an empty 307 to http://… that SDKs follow without the credential.
    headers = _anthropic(key) if dialect == "anthropic" else bearer(key)
    response = app.client.request(method, path, json={"model": MODEL}, headers=headers, follow_redirects=False)
    assert response.status_code == 404 and "location" not in response.headers
    error = response.json()["error"]
    assert f"the route is {path.rstrip('/')!r}, without the trailing slash" in error["message"]
    assert (error["type"] == "not_found_error") if dialect == "anthropic" else (error["code"] == "not_found")
    assert app.engine.calls == []


def test_a_path_that_is_no_route_with_or_without_its_slash_says_not_found(app, key):
    response = app.client.get("/v1/nothing/", headers=bearer(key), follow_redirects=False)
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"


@pytest.mark.parametrize("prompt", [[], [[1], []], [-1]])
def test_an_empty_or_negative_completions_prompt_is_a_400_naming_it_not_a_500(app, key, prompt):
    for extra in ({}, {"max_tokens": 4}, {"stream": True}):
        response = app.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **extra},
                                   headers=bearer(key))
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"].startswith("prompt"), response.text
    assert app.engine.calls == []


@pytest.mark.parametrize("prompts, n, param", [(500, 128, "n"), (MAX_SEQUENCES + 1, None, "prompt"), (2, 65, "n")])
def test_one_request_cannot_ask_the_engine_for_more_sequences_than_chat_n_allows(app, key, prompts, n, param):
    body = {"model": MODEL, "prompt": ["a"] * prompts, "max_tokens": 1, **({"n": n} if n else {})}
    response = app.client.post("/v1/completions", json=body, headers=bearer(key))
    error = response.json()["error"]
    assert response.status_code == 400 and (error["code"], error["param"]) == ("too_many_sequences", param)
    assert app.engine.calls == []
    fits = {"model": MODEL, "prompt": ["a"] * 2, "n": MAX_SEQUENCES // 2, "max_tokens": 1}
    assert app.client.post("/v1/completions", json=fits, headers=bearer(key)).status_code == 200


def test_a_model_that_is_not_a_string_is_said_so_and_a_long_one_is_not_echoed_whole(app, key):
    messages = [{"role": "user", "content": "hi"}]
    response = app.client.post("/v1/chat/completions", json={"model": 5, "messages": messages}, headers=bearer(key))
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "string" in response.json()["error"]["message"]
    response = app.client.post("/v1/chat/completions", json={"model": "m" * 100_000, "messages": messages},
                               headers=bearer(key))
    assert response.status_code == 404 and len(response.content) < 1_000


def test_a_messages_tool_choice_that_forces_a_tool_not_given_is_a_400(app, key):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": {"type": "tool", "name": "nope"}}
    response = app.client.post("/v1/messages", json=body, headers=_anthropic(key))
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "tools" in response.json()["error"]["message"]
    assert app.engine.calls == []


def test_a_client_that_leaves_while_sending_its_body_is_a_499_not_a_router_fault(app, key, caplog):
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = [(name.lower().encode(), value.encode()) for name, value in bearer(key).items()]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw) + 100).encode())]
    chunks = [{"type": "http.request", "body": raw[:10], "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return chunks.pop(0)

    request = Request({"type": "http", "method": "POST", "path": surfaces.CHAT.route, "headers": headers,
                       "query_string": b""}, receive)
    response = app.run(lambda: pipeline.run(app.services, request, surfaces.CHAT))
    assert response.status_code == 499
    assert all(row["status"] == 499 and row["completion_tokens"] == 0 for row in app.recorded())
    assert app.engine.calls == [] and "Traceback" not in caplog.text and "unhandled" not in caplog.text


def test_a_messages_tool_whose_input_is_not_an_object_is_a_400_before_the_engine_runs(app, key):
    tool = {"name": "f", "input_schema": {"type": "array", "items": {"type": "integer"}}}
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
            "tool_choice": {"type": "tool", "name": "f"}}
    response = app.client.post("/v1/messages", json=body, headers=_anthropic(key))
    assert response.status_code == 400 and "object" in response.json()["error"]["message"]
    assert app.engine.calls == []


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ""}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["end", ""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop"),
    # More than vLLM takes (VLLM_MAX_STOP_STRINGS): refused by the engine after admission before.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": list("abcde")}, "stop"),
    ("/v1/responses", {"input": "hi", "stop": list("abcde")}, "stop"),  # a vLLM extra there
    ("/v1/responses", {"input": "hi", "stop": ""}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 5},
     "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                              "max_completion_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": "hi", "previous_response_id": ""}, "previous_response_id"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_a_check_across_fields_names_the_field_to_change(app, key, path, body, param):
    """vLLM refused these too, naming nothing (``param`` null), or took "" as no id at all."""
    response = app.client.post(path, json={"model": MODEL, **body}, headers=bearer(key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert app.engine.calls == []


def test_an_empty_stop_sequence_is_refused_on_messages_too(app, key):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]}
    response = app.client.post("/v1/messages", json=body, headers=_anthropic(key))
    error = response.json()["error"]
    assert (response.status_code, error["type"]) == (400, "invalid_request_error")
    assert "stop_sequences" in error["message"] and "empty" in error["message"]
    assert app.engine.calls == []


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "min_tokens": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5}),
    ("/v1/completions", {"prompt": "hi", "stop": ["end"], "max_tokens": 4}),
])
def test_what_the_checks_across_fields_allow_is_served(app, key, path, body):
    response = app.client.post(path, json={"model": MODEL, **body}, headers=bearer(key))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("part, param, words", [
    ({"type": "input_txt", "text": "hi"}, "input[0].content[0].type", "'input_txt' do not exist"),
    ({"type": "input_text"}, "input[0].content[0].text", "needs a string 'text'"),
    ({"type": "refusal", "text": "no"}, "input[0].content[0].refusal", "needs a string 'refusal'"),
    ({"text": "hi"}, "input[0].content[0].type", "needs a 'type'"),
])
def test_a_responses_content_part_is_named_where_it_is_wrong(app, key, part, param, words):
    """vLLM's own answer is a union's complaints (``input.0.EasyInputMessageParam.content…``), and
    a typo of a type was refused as media."""
    body = {"model": MODEL, "input": [{"role": "user", "content": [part]}]}
    response = app.client.post("/v1/responses", json=body, headers=bearer(key))
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"], error
    assert app.engine.calls == []


@pytest.mark.parametrize("extra", ["x", {}, [], 3])
def test_completions_reads_no_max_completion_tokens_of_its_own_for_min_tokens(app, key, extra):
    """Completions has no such field (vLLM reads only max_tokens there): a client's extra of that
    name is neither compared with min_tokens (a str or dict would crash it) nor blamed on it."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "min_tokens": 5, "max_completion_tokens": extra}
    response = app.client.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_completion_tokens", response.text


def test_an_empty_input_with_instructions_is_answered(app, key):
    """vLLM renders the instructions alone as a system turn and answers it."""
    body = {"model": MODEL, "input": [], "instructions": "Say hi."}
    assert app.client.post("/v1/responses", json=body, headers=bearer(key)).status_code == 200


def test_a_messages_tool_choice_naming_a_tool_not_given_names_it_short(app, key):
    tools = [{"name": "lookup", "input_schema": {"type": "object"}}]
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "tool_choice": {"type": "tool", "name": "n" * 5000}}
    response = app.client.post("/v1/messages", json=body, headers=bearer(key))
    assert response.status_code == 400 and len(response.text) < 600, response.text[:300]
    assert "not one of 'tools'" in response.json()["error"]["message"]
