"""The spine end to end: official openai SDK → Serve proxy → Router → ModelServer → vLLM (CPU)."""

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
EMBEDDING_MODEL = "qwen-3-embedding-0.6b"  # beside it in configs/local.yaml (test_embeddings.py)
MESSAGES = [{"role": "user", "content": "Say hi in one short sentence."}]
# Tests that assert an answer has text ask for it greedy: a sampled 8-token answer of the tiny
# model is empty now and then (1 in 30, measured), the greedy one the same every time.
GREEDY = {"temperature": 0}


def test_models_lists_the_canonical_id(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, EMBEDDING_MODEL]
    assert client.models.retrieve("qwen-3.6-a3b").id == MODEL


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0}])
def test_a_request_without_max_tokens_ends_its_turn(client, sampling):
    # The tiny model ends its turns (tiny_model.END_OF_TURN_PRIOR), so a client that sends no
    # max_tokens gets an answer, not 8192 tokens of noise.
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, **sampling)
    (choice,) = reply.choices
    assert choice.finish_reason == "stop"
    assert choice.message.content
    assert 0 < reply.usage.completion_tokens < 300


@pytest.mark.parametrize("name", [MODEL, "qwen-3.6-a3b", "Qwen/Qwen3.6-35B-A3B-FP8"])
def test_chat_non_stream_answers_under_the_canonical_id(client, name):
    reply = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert reply.model == MODEL
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    assert reply.usage.prompt_tokens > 0
    assert 0 < reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


@pytest.mark.parametrize("name", [MODEL, "qwen-3.6-a3b"])
def test_chat_stream_yields_deltas_one_finish_reason_and_usage(client, name):
    stream = client.chat.completions.create(
        model=name,
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, finish_reasons, usage = [], [], None
    for chunk in stream:
        assert chunk.model == MODEL
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish_reasons.append(choice.finish_reason)
    assert "".join(text)
    assert len(finish_reasons) == 1
    assert usage is not None and 0 < usage.completion_tokens <= 12


@pytest.mark.anyio
async def test_async_chat_stream(async_client):
    stream = await async_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, stream=True, **GREEDY
    )
    contents = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
    assert "".join(c for c in contents if c)


def test_completions_non_stream_and_stream(client):
    reply = client.completions.create(model="qwen-3.6-a3b", prompt="Hello", max_tokens=6, **GREEDY)
    assert reply.model == MODEL
    assert reply.choices[0].text
    assert reply.usage.completion_tokens <= 6

    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 1


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=4)
    error = err.value.body
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert "gpt-4o" in error["message"]


def test_unknown_model_in_a_stream_request_is_also_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=4, stream=True)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL}, "messages"),
        ({"messages": MESSAGES}, "model"),
    ],
)
def test_bad_body_is_an_openai_style_400(base_url, auth_headers, body, param):
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=auth_headers, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert param in (error["param"] or "")
    assert "Traceback" not in response.text


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_non_json_body_is_400(base_url, auth_headers, raw):
    response = httpx.post(
        f"{base_url}/v1/chat/completions", content=raw, headers={"content-type": "application/json", **auth_headers}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_bad_body_through_the_sdk_is_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-3)


def test_unknown_route_is_an_openai_style_404(base_url):
    response = httpx.get(f"{base_url}/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_health_reports_the_model_ready(base_url):
    response = httpx.get(f"{base_url}/health", timeout=30)
    assert response.status_code == 200
    assert response.json()["models"] == {MODEL: True, EMBEDDING_MODEL: True}


def _unfinished(model_handle) -> int:
    return model_handle.engine_stats.remote().result()["unfinished_requests"]


def test_client_disconnect_mid_stream_aborts_the_engine_request(base_url, auth_headers, model_handle):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 8000,
        "ignore_eos": True,  # keep generating until the client leaves
        "stream": True,
    }
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=auth_headers, timeout=60) as response:
        assert response.status_code == 200
        events = response.iter_lines()
        received = [line for _, line in zip(range(6), events) if line.startswith("data:")]
        assert received
        assert _unfinished(model_handle) == 1  # still generating while we hold the stream
    # The connection is closed now. The abort travels proxy → router → replica → engine.
    deadline = time.monotonic() + 10
    while _unfinished(model_handle) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _unfinished(model_handle) == 0
