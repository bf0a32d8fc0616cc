"""``/tokenize`` and ``/detokenize`` at the router, without Ray: the real router on a fake engine
(``router_app.py``): auth order, validation, alias, model scope, the rate-limit charge by size,
model state, the replica call and the JSON answer."""

import subprocess
import sys

import pytest
from auth_support import MODEL, OTHER_MODEL, authenticator, bearer
from fake_engine import TOKENIZED, FakeEngine
from serve_app.auth.ratelimit import RateLimiter
from serve_app.engine import tokenization as replica_rules
from serve_app.router import ingress, openapi

TOKENIZE = {"model": "qwen-3.6-a3b", "prompt": "Hello world"}


@pytest.fixture
def app(router_app, tmp_path):
    # A limiter whose clock stands still: its buckets do not refill between requests, so what
    # each request was charged reads off the headers exactly.
    app = router_app(auth=authenticator(tmp_path, limiter=RateLimiter(clock=lambda: 1000.0)))
    app.key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    return app


def post(app, path, body, key=None, **kwargs):
    return app.client.post(path, json=body, headers=bearer(key or app.key), **kwargs)


def _charged(response) -> tuple[int, int]:
    """What the key has left after ``response`` (requests, tokens), from its rate-limit headers."""
    return int(response.headers["x-ratelimit-remaining-requests"]), int(response.headers["x-ratelimit-remaining-tokens"])


def test_tokenize_resolves_the_alias_charges_its_size_and_answers_the_replicas_body(app):
    response = post(app, "/tokenize", TOKENIZE)
    assert response.status_code == 200
    body = response.json()
    assert {key: body[key] for key in TOKENIZED} == TOKENIZED
    assert body["pg_metadata"]["model"] == MODEL
    assert "total;dur=" in response.headers["server-timing"] and response.headers["x-pg-region"] == "local"
    ((surface, call),) = app.engine.calls
    assert (surface, call.body) == ("tokenize", {"model": MODEL, "prompt": "Hello world"})
    # Charged one request and its size in tokens (what the replica tokenizes), never a flat 1:
    # a 2 MiB body is not a free 1-token request.
    requests, tokens = _charged(response)
    size = len(response.request.content)
    assert (600 - requests, 1_000_000 - tokens) == (1, size // 4)
    big = post(app, "/tokenize", {"model": MODEL, "prompt": "word " * 20_000})
    assert tokens - _charged(big)[1] == len(big.request.content) // 4 > 25_000
    assert app.services.in_flight.load(MODEL, 1)["in_flight"] == 0  # the slot is given back


def test_detokenize_goes_to_the_replicas_detokenize(app):
    response = post(app, "/detokenize", {"model": MODEL, "tokens": [9707, 1879]})
    assert response.status_code == 200 and response.json()["prompt"] == "t1 t2"
    assert app.engine.calls[0][0] == "detokenize"


@pytest.mark.parametrize(
    "method, body, param",
    [
        ("tokenize", {"model": MODEL}, None),
        ("tokenize", {"model": MODEL, "prompt": 42}, "prompt"),
        ("tokenize", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("tokenize", {"model": MODEL, "prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("tokenize", {"model": MODEL, "prompt": "x", "tools": [], "enable_thinking": False}, "tools"),
        ("tokenize", {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ("tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                      "continue_final_message": True}, "continue_final_message"),
        ("tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("detokenize", {"model": MODEL, "tokens": [1, -2]}, "tokens[1]"),
        ("detokenize", {"model": MODEL, "tokens": [1, True]}, "tokens[1]"),
        ("detokenize", {"model": MODEL, "tokens": "1 2"}, "tokens"),
        ("detokenize", {"model": MODEL}, "tokens"),
    ],
)
def test_bad_bodies_are_400_before_anything_is_sent_and_cost_one_request(app, method, body, param):
    response = post(app, f"/{method}", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert app.engine.calls == []
    assert _charged(post(app, "/tokenize", TOKENIZE))[0] == 598  # the refusal cost one request too


def test_no_credential_is_401_before_the_body_is_read(app):
    response = app.client.post("/tokenize", content=b"{not json")
    assert response.status_code == 401  # not the body's 400: the body was not read


def test_unknown_model_is_404_and_a_model_outside_the_keys_scope_is_403(app):
    assert post(app, "/tokenize", {"model": "gpt-5", "prompt": "x"}).status_code == 404
    narrow, _ = app.auth.keys.create_key(owner="bob", tier="standard", models=(OTHER_MODEL,))
    response = post(app, "/tokenize", {"model": MODEL, "prompt": "x"}, key=narrow)
    assert response.status_code == 403
    allowed = post(app, "/tokenize", {"model": OTHER_MODEL, "prompt": "x"}, key=narrow)
    assert _charged(allowed)[0] == 598  # the refused request cost one request too


def test_a_model_not_loaded_here_is_503_with_retry_after(app):
    app.serve.stop(MODEL)
    app.run(app.services.states.refresh)
    response = post(app, "/tokenize", {"model": MODEL, "prompt": "x"})
    assert response.status_code == 503 and response.headers["retry-after"] == "30"
    assert app.engine.calls == []


def test_a_model_not_loaded_here_fails_over_to_a_peer_region_like_any_request(tmp_path, router_app):
    """The peer serves the same model with the same tokenizer: its answer is relayed (it charges
    the key's limits there: rate limits are per region)."""
    import httpx
    from auth_support import federated_regions
    from serve_app.config import Peer

    seen = []

    def peer(request):
        seen.append(request.url.path)
        return httpx.Response(200, json=dict(TOKENIZED))

    yul = federated_regions(tmp_path, "yul-02", "yvr-01")["yul-02"]
    app = router_app(auth=yul, region="yul-02", peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                     transport=httpx.MockTransport(peer))
    app.serve.stop(MODEL)
    app.run(app.services.states.refresh)
    key, _ = yul.keys.create_key(owner="alice", tier="standard")
    response = post(app, "/tokenize", {"model": MODEL, "prompt": "x"}, key=key)
    assert response.status_code == 200 and response.json()["count"] == TOKENIZED["count"]
    assert seen == ["/tokenize"] and app.engine.calls == []


def test_the_replicas_error_is_answered_with_its_status(router_app):
    app = router_app(engine=FakeEngine(refuse=400))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response = post(app, "/detokenize", {"model": MODEL, "tokens": [999999]}, key=key)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_the_replica_refuses_ids_past_the_tokenizer_by_index():
    assert replica_rules.first_unknown_token([], 10) is None
    assert replica_rules.first_unknown_token([0, 9], 10) is None
    assert replica_rules.first_unknown_token([3, 10, 12], 10) == 1
    assert "ids 0 to 9" in replica_rules.unknown_token_message(10, 10)


def test_a_completions_prompt_of_ids_is_refused_at_the_first_id_past_the_tokenizer():
    """vLLM refuses it as the engine takes the request, naming no field, and for a stream of
    several prompts only after merging their streams (a 200 and an error event)."""
    unknown = replica_rules.unknown_prompt_token
    assert unknown([1, 12, 3], 10) == ("prompt[1]", replica_rules.unknown_token_message(12, 10))
    assert unknown([[1, 2], [3, 4, 10]], 10)[0] == "prompt[1][2]"
    assert unknown([[1, 2], [3]], 10) is None and unknown([1, 9], 10) is None
    assert unknown("text", 10) is None and unknown(["a", "b"], 10) is None and unknown([], 10) is None


def test_the_replica_never_streams_a_tokenization():
    body = {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    replica_rules.never_stream(body)
    assert body == {"model": MODEL, "prompt": "x"}


def test_openapi_publishes_both_bodies_with_the_inference_errors():
    schema = openapi.build(ingress.app)
    for path, model in (("/tokenize", "TokenizeBody"), ("/detokenize", "DetokenizeBody")):
        operation = schema["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"400", "401", "403", "404", "413", "429", "503"} <= set(operation["responses"])
        assert "422" not in operation["responses"]
    assert "messages" in schema["components"]["schemas"]["TokenizeBody"]["properties"]


def test_the_router_side_never_imports_vllm():
    code = "import sys, serve_app.router.ingress, serve_app.router.pipeline; print('vllm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_what_the_tokenizer_really_counted_is_charged_beyond_the_size_estimate(router_app, tmp_path):
    """A body of digits tokenizes at about a token a byte, four times its size estimate: the rest
    is charged to the key's tokens/min once the answer says what was counted, as a generation's
    real prompt is (docs/auth.md), so /tokenize is no way around the tier's minute."""
    app = router_app(auth=authenticator(tmp_path, limiter=RateLimiter(clock=lambda: 1000.0)),
                     engine=FakeEngine(counted=5_000))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    digits = {"model": MODEL, "prompt": "7" * 5_000}
    first = post(app, "/tokenize", digits, key)
    assert first.status_code == 200 and first.json()["count"] == 5_000
    estimate = len(first.request.content) // 4
    _, left_before = _charged(first)  # after its estimate
    second = post(app, "/tokenize", digits, key)
    _, left_after = _charged(second)
    # The second was charged its estimate; the first's miss (what it counted beyond it) came in between.
    assert left_before - left_after == estimate + (5_000 - estimate)
    # Anthropic's count_tokens too (its input_tokens), on the same key.
    counting = {"model": MODEL, "messages": [{"role": "user", "content": "7" * 400}]}
    third = app.client.post("/v1/messages/count_tokens", json=counting, headers={"x-api-key": key})
    assert third.status_code == 200 and third.json()["input_tokens"] == 5_000
    fourth = post(app, "/tokenize", digits, key)
    charged_between = left_after - _charged(fourth)[1]  # second's miss, third's estimate and miss, fourth's estimate
    assert charged_between == (5_000 - estimate) + 5_000 + estimate


def test_detokenize_is_priced_by_its_ids_exactly(app):
    ids = [1] * 2_000  # "1,1,…": 2 bytes an id, so its size alone would say ~1,000
    response = post(app, "/detokenize", {"model": MODEL, "tokens": ids})
    assert len(response.request.content) // 4 < len(ids)
    assert 1_000_000 - _charged(response)[1] == len(ids)


def test_a_client_that_leaves_before_the_count_is_still_charged_what_was_counted(router_app, tmp_path):
    """The count is the charge (above): a client that hangs up before the replica's answer, to be
    charged its size estimate only (a fourth of what digits count), still has the count charged."""
    import asyncio
    import contextlib

    import httpx

    from serve_app.router.context import wait_settled

    app = router_app(auth=authenticator(tmp_path, limiter=RateLimiter(clock=lambda: 1000.0)),
                     engine=FakeEngine(counted=5_000, latency_s=0.3))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    digits = {"model": MODEL, "prompt": "7" * 5_000}
    first = post(app, "/tokenize", digits, key)
    estimate = len(first.request.content) // 4
    _, left_before = _charged(first)

    async def leave_before_the_answer():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ingress.app), base_url="http://r") as client:
            calls = len(app.engine.calls)
            asking = asyncio.ensure_future(client.post("/tokenize", json=digits, headers=bearer(key)))
            while len(app.engine.calls) == calls:  # admitted, charged its estimate; the replica counting
                await asyncio.sleep(0.005)
            asking.cancel()  # the client hangs up: Serve cancels the request's task
            with contextlib.suppress(asyncio.CancelledError):
                await asking
        await wait_settled()
        return asking.cancelled()

    assert app.run(leave_before_the_answer)  # it left before any answer
    third = post(app, "/tokenize", digits, key)
    # Between: the first's miss, the one that left (its estimate and its miss), the third's estimate.
    assert left_before - _charged(third)[1] == (5_000 - estimate) + 5_000 + estimate
