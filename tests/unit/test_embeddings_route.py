"""``POST /v1/embeddings`` on the real router (its pipeline, services, ledger, limiter, tracing)
in front of the real ``ModelServer`` on a fake engine (``router_app.py``): an embedding model is
one more model, and everything the other surfaces get applies to it — keys, scopes, the model's
task, rate limits charged by input tokens, the budget's escrow, one usage record, spans, hot-load
state and failover. The body refusals are in ``test_embeddings_schema.py``."""

import base64
import json
import pathlib
import struct

import httpx
import pytest
from jsonschema import Draft202012Validator

from auth_support import MODEL, bearer
from fake_engine import EMBEDDING_DIMENSIONS, FakeEngine, embedding_of
from serve_app.auth.config import Tier
from serve_app.config import Peer
from serve_app.router.isolation import cache_salt
from serve_app.telemetry import tracing
from serve_app.telemetry.config import TracingArgs

EMBED = "qwen-3-embedding-0.6b"
MODELS = (MODEL, EMBED)
SCHEMAS = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data/schemas/openai_embeddings.json").read_text())
TIERS = {
    "standard": Tier(requests_per_minute=600, tokens_per_minute=1_000_000, priority=30),
    "tiny": Tier(requests_per_minute=100, tokens_per_minute=1_000),
    "dev": Tier(requests_per_minute=600, tokens_per_minute=1_000_000),
}


def schema(name: str) -> Draft202012Validator:
    return Draft202012Validator({**SCHEMAS, "$ref": f"#/components/{name}"})


@pytest.fixture
def app(router_app):
    return router_app(models=MODELS, tiers=TIERS)


def embed(app, key: str, **body):
    return app.client.post("/v1/embeddings", json={"model": EMBED, "input": "hello world", **body}, headers=bearer(key))


def test_float_embeddings_are_openais_response_exactly_with_timing(app):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response = embed(app, key, input=["hello world", "hello world", "other words here"])
    assert response.status_code == 200
    body = response.json()
    metadata = body.pop("pg_metadata")
    # OpenAI's CreateEmbeddingResponse, closed: no vLLM extras (id, created, completion_tokens).
    closed = {**SCHEMAS["components"]["CreateEmbeddingResponse"], "additionalProperties": False}
    Draft202012Validator({**SCHEMAS, **closed}).validate(body)
    assert set(body) == {"object", "data", "model", "usage"} and body["model"] == EMBED
    assert [set(item) for item in body["data"]] == [{"object", "index", "embedding"}] * 3
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    vectors = [item["embedding"] for item in body["data"]]
    assert vectors[0] == vectors[1] != vectors[2] and len(vectors[0]) == EMBEDDING_DIMENSIONS
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}  # the engine's count
    # The engine's timing (pooling_timing): 4 ms of compute, as the fake engine's stats say.
    assert metadata["inference_total_ms"] == pytest.approx(4.0, abs=0.01) and metadata["model"] == EMBED
    assert "inference;dur=4.0" in response.headers["server-timing"]


def test_the_router_relays_the_vectors_as_the_replica_encoded_them(app, monkeypatch):
    """2,048 inputs of 1,024 floats are a 42 MB body that the router decoded (unpickled) and
    encoded again on its event loop (0.9 s, every stream of the router waiting): it now adds its
    pg_metadata to the replica's JSON text (test_embeddings_encoded.py)."""
    from serve_app.router import relay

    class NotHere(relay.JSONResponse):
        def render(self, content):
            if isinstance(content, dict) and "data" in content:
                raise AssertionError("the embeddings body was encoded again in the router")
            return super().render(content)

    monkeypatch.setattr(relay, "JSONResponse", NotHere)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response = embed(app, key, input=["hello world", "other"])
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    body = response.json()
    assert len(body["data"]) == 2 and body["pg_metadata"]["model"] == EMBED and body["usage"]["prompt_tokens"] == 3


def test_base64_embeddings_decode_to_the_float_vector(app):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    as_float = embed(app, key, input=[[5, 6, 7]]).json()["data"][0]["embedding"]
    encoded = embed(app, key, input=[[5, 6, 7]], encoding_format="base64").json()["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == as_float == embedding_of([5, 6, 7], EMBEDDING_DIMENSIONS)
    assert len(embed(app, key, dimensions=4).json()["data"][0]["embedding"]) == 4


def test_the_replica_gets_the_body_with_the_tiers_priority_and_the_owners_cache_salt(app):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    assert embed(app, key, user="u-1").status_code == 200
    surface, call = app.engine.calls[-1]
    assert surface == "embeddings"
    assert call.body == {"model": EMBED, "input": "hello world", "user": "u-1", "priority": 30}
    # The owner's prefix-cache partition: a pooling model with last-token pooling caches prefixes.
    assert call.cache_salt == cache_salt("alice") and len(call.request_id) == 32


def test_an_embedding_is_recorded_once_in_the_ledger_with_the_engines_prompt_tokens(app):
    key, record = app.auth.keys.create_key(owner="alice", tier="standard")
    assert embed(app, key, input=["one two three", "four five"]).status_code == 200
    (row,) = app.recorded()
    assert (row["key_id"], row["model"], row["route"], row["status"]) == (record.key_id, EMBED, "/v1/embeddings", 200)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (5, 0)
    # A body the router refuses reaches no engine and is not recorded.
    assert embed(app, key, input="").status_code == 400
    assert len(app.recorded()) == 1 and len(app.engine.calls) == 1


def test_an_embedding_whose_client_leaves_stops_the_engine_and_is_billed_the_inputs_it_finished(router_app):
    """Send 200 inputs, leave after a few: the engine stops at once, and the inputs it did embed
    are billed — leaving is no way to embed for free."""
    from serve_app import surfaces
    from test_pipeline import leave_once

    engine = FakeEngine(latency_s=0.01)
    app = router_app(models=MODELS, tiers=TIERS, engine=engine)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": EMBED, "input": [[7, 8, 9]] * 200}
    leave_once(app, surfaces.EMBEDDINGS, body, key, lambda: engine.embedded >= 5)
    (row,) = app.recorded()
    assert row["status"] == 499 and row["route"] == "/v1/embeddings"
    assert 5 <= engine.embedded < 200 and row["prompt_tokens"] == 3 * engine.embedded
    assert engine.closed_early == 1  # the input under way was aborted, not run to the end
    assert app.services.in_flight.load(EMBED, 1)["in_flight"] == 0


def test_the_budget_holds_an_embeddings_input_estimate_and_counts_what_it_recorded(app):
    key, record = app.auth.keys.create_key(owner="alice", tier="standard")
    app.meter.store.set_budget(record.key_id, tokens_per_day=100, tokens_per_month=None)
    # ~1,200 bytes of input: an estimate of ~300 tokens, more than the 100 left: held, refused.
    refused = embed(app, key, input="word " * 240)
    assert (refused.status_code, refused.json()["error"]["code"]) == (429, "budget_exceeded")
    assert app.engine.calls == []
    served = embed(app, key, input="a few words")
    assert served.status_code == 200 and served.headers["x-budget-remaining-tokens-day"] == "100"
    assert app.recorded()[0]["prompt_tokens"] == 3  # spent from the budget from now on


def test_the_rate_limit_charges_token_id_inputs_by_their_exact_count(app):
    """A list of token ids is ~2 bytes a token ("7,"): priced by size it would cost half."""
    key, _ = app.auth.keys.create_key(owner="bob", tier="tiny")  # 1,000 tokens a minute
    ids = [7] * 600
    assert embed(app, key, input=ids).status_code == 200
    second = embed(app, key, input=ids)
    assert second.status_code == 429 and "retry-after" in second.headers
    assert len(app.engine.calls) == 1


@pytest.mark.parametrize("route, model, body", [
    ("/v1/chat/completions", EMBED, {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", EMBED, {"prompt": "hi"}),
    ("/v1/responses", EMBED, {"input": "hi"}),
    ("/v1/embeddings", MODEL, {"input": "hi"}),
])
def test_a_model_of_another_task_is_a_400_naming_the_model(app, route, model, body):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response = app.client.post(route, json={"model": model, **body}, headers=bearer(key))
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == ("model", "model_does_not_serve_route")
    assert app.engine.calls == [] and app.recorded() == []


def test_tokenize_works_on_the_embedding_model(app):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    response = app.client.post("/tokenize", json={"model": EMBED, "prompt": "hi"}, headers=bearer(key))
    assert response.status_code == 200


def test_a_key_scoped_to_the_chat_model_cannot_embed(app):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard", models=(MODEL,))
    assert embed(app, key).status_code == 403
    assert app.engine.calls == []


def test_a_key_kept_to_one_model_is_not_told_of_the_others_in_refusals(app):
    """``GET /v1/models`` lists only the models a key may use; the 404 of an unknown model and the
    400 of a model of the wrong task listed every model of the region, and a model the key may not
    use, sent to another task's route, got that 400 naming its task (found by reviews)."""
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard", models=(MODEL,))
    chat = {"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}
    unknown = app.client.post("/v1/chat/completions", json=chat, headers=bearer(key))
    assert unknown.status_code == 404 and MODEL in unknown.json()["error"]["message"]
    assert EMBED not in unknown.json()["error"]["message"]
    wrong_task = app.client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}, headers=bearer(key))
    assert wrong_task.json()["error"]["code"] == "model_does_not_serve_route"
    assert EMBED not in wrong_task.json()["error"]["message"]
    everything, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    told = app.client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}, headers=bearer(everything))
    assert EMBED in told.json()["error"]["message"]  # a key of every model is told where to go
    listed = app.client.get("/v1/models", headers=bearer(key)).json()["data"]
    assert [card["id"] for card in listed] == [MODEL]
    not_its_own = app.client.post("/v1/chat/completions", json={**chat, "model": EMBED}, headers=bearer(key))
    error = not_its_own.json()["error"]
    assert (not_its_own.status_code, error["code"]) == (403, "model_not_allowed")  # not its task: 400
    assert app.engine.calls == []


def test_the_embedding_model_is_listed_with_its_task_and_state(app):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    models = {m["id"]: m for m in app.client.get("/v1/models", headers=bearer(key)).json()["data"]}
    assert models[EMBED]["task"] == "embed" and models[MODEL]["task"] == "generate"
    assert models[EMBED]["state"] == "loaded"


def test_an_unloaded_embedding_model_is_a_503_that_costs_no_tokens(app):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    app.serve.stop(EMBED)
    app.run(app.services.states.refresh)
    response = embed(app, key)
    assert response.status_code == 503 and response.headers["retry-after"]
    assert app.engine.calls == []
    (row,) = app.recorded()  # as every admitted request: its 503, with no tokens
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == (503, 0, 0)
    state = app.client.get(f"/v1/models/{EMBED}", headers=bearer(key)).json()["state"]
    assert state != "loaded"


def test_an_embedding_fails_over_to_a_peer_which_bills_it(router_app):
    seen: list[httpx.Request] = []

    def peer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"object": "list", "data": [], "model": EMBED,
                                         "usage": {"prompt_tokens": 2, "total_tokens": 2}})

    app = router_app(models=MODELS, tiers=TIERS, peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                     transport=httpx.MockTransport(peer))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    app.serve.stop(EMBED)
    app.run(app.services.states.refresh)
    response = embed(app, key)
    assert response.status_code == 200 and response.json()["model"] == EMBED
    (forwarded,) = seen
    assert forwarded.url.path == "/v1/embeddings" and json.loads(forwarded.content)["model"] == EMBED
    assert app.engine.calls == [] and app.recorded() == []  # the region that served it records it


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracing.shutdown_tracing()
    exporter = InMemorySpanExporter()
    tracing.setup_tracing(TracingArgs(enabled=True, sampling_ratio=1.0), region="local", deployment="Router",
                          replica="router-1", exporter=exporter, set_global=False)
    yield exporter
    tracing.shutdown_tracing()


def test_an_embedding_is_traced_as_the_embeddings_operation_with_the_engines_queue_and_inference(app, spans):
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    assert embed(app, key).status_code == 200
    app.recorded()  # settled
    named = {span.name: span for span in spans.get_finished_spans()}
    server = next(span for span in named.values() if span.attributes.get("gen_ai.operation.name"))
    assert server.attributes["gen_ai.operation.name"] == "embeddings"
    assert server.attributes["gen_ai.request.model"] == EMBED
    # The fake engine's stats: queued 1 ms, then 4 ms of compute (pooling_timing).
    queue, inference = named["queue"], named["inference"]
    assert (inference.end_time - inference.start_time) / 1e6 == pytest.approx(4.0, abs=0.01)
    assert (queue.end_time - queue.start_time) / 1e6 >= 1.0


@pytest.mark.parametrize("route, body, param", [
    ("/v1/embeddings", {"model": EMBED, "input": [7] * 1_200}, "input"),  # priced by its ids, at admission
    ("/v1/embeddings", {"model": EMBED, "input": "word " * 1_000}, "input"),  # its declared size, unread
    ("/detokenize", {"model": MODEL, "tokens": [7] * 1_200}, "tokens"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2_000}, "max_output_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 2_000}, "max_completion_tokens"),
])
def test_a_request_too_big_for_its_tier_names_the_field_to_change(app, route, body, param):
    """Before: max_tokens whatever the route, a field embeddings refuse and Responses does not have."""
    key, _ = app.auth.keys.create_key(owner="bob", tier="tiny")  # 1,000 tokens a minute
    refused = app.client.post(route, json=body, headers=bearer(key))
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == (400, "request_exceeds_tier_limit", param)
    assert param in error["message"] and not app.engine.calls


@pytest.mark.parametrize("field, value", [("truncate_prompt_tokens", 10**6), ("dimensions", 4096)])
def test_a_field_past_the_model_is_refused_before_admission_naming_it(app, field, value):
    """vLLM refuses these only once the request is admitted, as a ValueError with no param (the
    replica named it `input`): a 400 for another field, a ledger row and its tokens kept."""
    key, _ = app.auth.keys.create_key(owner="bob", tier="tiny")  # 1,000 tokens a minute
    refused = embed(app, key, **{field: value})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, field)
    assert not app.engine.calls and not app.recorded()
    served = embed(app, key)
    assert served.status_code == 200 and int(served.headers["x-ratelimit-remaining-tokens"]) > 980  # its ~13 only


def test_a_request_without_a_limit_over_its_tier_by_its_prompt_names_the_prompt(app):
    """The router set its limit from what the tier leaves (here nothing): lowering a limit the
    client never set cannot help, its prompt can (a Responses follow-up's history the same)."""
    key, _ = app.auth.keys.create_key(owner="bob", tier="tiny")  # 1,000 tokens a minute: 4,000 bytes
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}]}
    body["messages"][0]["content"] = "x" * (4_000 - len(json.dumps(body)))
    refused = app.client.post("/v1/chat/completions", content=json.dumps(body), headers=bearer(key))
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == (400, "request_exceeds_tier_limit", "messages")
    assert "max_completion_tokens" not in error["message"]
