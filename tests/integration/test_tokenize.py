"""``/tokenize`` and ``/detokenize`` end to end, and schema-exact non-stream chat/completions bodies.

Router → ModelServer → vLLM's own tokenization serving object (CPU, the tiny model). The counts
must be the ones chat and completions see, and a round trip must give the text back.
"""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
OTHER_MODEL = "qwen-3.5-27b"
TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé, emoji 🦊, and	tabs."
MESSAGES = [{"role": "user", "content": "Say hi in one short sentence."}]


def _post(base_url: str, path: str, body: dict, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("name", [MODEL, "qwen-3.6-a3b"])
def test_tokenize_round_trips_through_detokenize(base_url, auth_headers, name):
    tokenized = _post(base_url, "/tokenize", {"model": name, "prompt": TEXT}, auth_headers)
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == 8192
    assert "token_strs" not in body  # not asked for: absent, not null
    assert "total;dur=" in tokenized.headers["server-timing"]
    detokenized = _post(base_url, "/detokenize", {"model": name, "tokens": body["tokens"]}, auth_headers)
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json()["prompt"] == TEXT


def test_token_strs_when_asked(base_url, auth_headers):
    body = _post(base_url, "/tokenize", {"model": MODEL, "prompt": "Hello world", "return_token_strs": True},
                 auth_headers).json()
    assert len(body["token_strs"]) == body["count"]


def test_a_completion_prompt_count_is_what_completions_bills(base_url, auth_headers):
    count = _post(base_url, "/tokenize", {"model": MODEL, "prompt": TEXT}, auth_headers).json()["count"]
    reply = _post(base_url, "/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 1}, auth_headers)
    assert reply.json()["usage"]["prompt_tokens"] == count


def test_a_chat_count_is_what_chat_bills(base_url, auth_headers):
    count = _post(base_url, "/tokenize", {"model": MODEL, "messages": MESSAGES}, auth_headers).json()["count"]
    reply = _post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 1},
                  auth_headers)
    assert reply.json()["usage"]["prompt_tokens"] == count


def test_the_generation_prompt_adds_tokens(base_url, auth_headers):
    def count(**fields):
        body = {"model": MODEL, "messages": MESSAGES, **fields}
        return _post(base_url, "/tokenize", body, auth_headers).json()["count"]

    assert count(add_generation_prompt=True) > count(add_generation_prompt=False)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_both_need_a_credential(base_url, path):
    response = httpx.post(f"{base_url}{path}", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"model": MODEL}, None),
        ("/tokenize", {"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
        ("/detokenize", {"model": MODEL, "tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"model": MODEL, "tokens": ["1"]}, "tokens[0]"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(base_url, auth_headers, path, body, param):
    response = _post(base_url, path, body, auth_headers)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_an_id_past_the_vocabulary_is_a_400_from_the_replica(base_url, auth_headers):
    response = _post(base_url, "/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, auth_headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tokens[1]"


def test_unknown_model_is_404(base_url, auth_headers):
    response = _post(base_url, "/tokenize", {"model": "gpt-5", "prompt": "x"}, auth_headers)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_model_outside_the_keys_scope_is_403(base_url, serve_app):
    cli = str(Path(sys.executable).with_name("serve-app"))
    done = subprocess.run(
        [cli, "--config", str(serve_app["config_path"]), "keys", "create", "--owner", "it-tok", "--model", OTHER_MODEL],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    headers = {"Authorization": f"Bearer {done.stdout.strip()}"}
    response = _post(base_url, "/tokenize", {"model": MODEL, "prompt": "x"}, headers)
    assert response.status_code == 403 and response.json()["error"]["code"] == "model_not_allowed"


def test_non_stream_chat_body_is_schema_exact(base_url, auth_headers):
    body = _post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
                 auth_headers).json()
    # system_fingerprint stays: vLLM fills it with a string, as the spec allows.
    for key in ("service_tier", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params"):
        assert key not in body, key
    choice = body["choices"][0]
    assert "logprobs" in choice and "token_ids" not in choice and "stop_reason" not in choice
    message = choice["message"]
    assert "content" in message and "refusal" in message
    for key in ("annotations", "function_call", "audio"):
        assert key not in message, key
    assert body["usage"].get("prompt_tokens_details", {}) is not None


def test_token_ids_come_back_when_asked(base_url, auth_headers):
    body = _post(base_url, "/v1/chat/completions",
                 {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "return_token_ids": True}, auth_headers).json()
    assert body["prompt_token_ids"] and body["choices"][0]["token_ids"]


def test_non_stream_completion_body_is_schema_exact(base_url, auth_headers):
    body = _post(base_url, "/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4},
                 auth_headers).json()
    assert "service_tier" not in body and "kv_transfer_params" not in body
    choice = body["choices"][0]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
