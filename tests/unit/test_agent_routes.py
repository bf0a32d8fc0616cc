"""The Responses and Messages routes at the router, on a fake engine (no Ray, no vLLM): the
router's own code path — credential (Bearer or x-api-key), validation, conversations continued
from the region store, ownership, and Anthropic-shaped errors on Anthropic's routes."""

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from auth_support import MODEL, api_app, authenticator, bearer
from serve_app.auth.config import Tier
from serve_app.config import ResponsesArgs
from serve_app.router import ingress
from serve_app.hot_load.tracker import InFlight
from serve_app.router.metering import Meter
from serve_app.router.response_store import ResponseStore
from serve_app.router.responses import ResponsesAPI
from serve_app.usage.store import UsageStore

ROUTER = ingress.Router.func_or_class


class FakeCall:
    """One handle call: the head a replica would yield, then nothing (non-stream)."""

    def __init__(self, head):
        self._items = [head]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    def cancel(self):
        pass


class FakeEngine:
    """Answers like ModelServer's non-stream heads, and keeps every body it was sent."""

    def __init__(self):
        self.bodies: list[tuple[str, dict]] = []
        self.count = 0

    def __getattr__(self, method):
        engine = self

        class Method:
            def remote(self, body):
                engine.bodies.append((method, body))
                engine.count += 1
                head = {"status": 200, "stream": False, "body": engine.answer(method, body)}
                if method != "count_tokens":  # what ModelServer's trailer says the engine did
                    head["trailer"] = {"usage": {"prompt_tokens": 7, "completion_tokens": 3}, "replica": "m1",
                                       "generated": {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 2}}
                return FakeCall(head)

        return Method()

    def answer(self, method, body):
        if method == "responses":
            return {
                "id": f"resp_{self.count}", "object": "response", "status": "completed", "model": body["model"],
                "created_at": 1, "output": [{"type": "message", "role": "assistant", "status": "completed",
                                            "content": [{"type": "output_text", "text": f"answer {self.count}"}]}],
                "previous_response_id": body.get("pg_previous_response_id"),
            }
        return {"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}]}


class _States:
    async def ensure_fresh(self, *args, **kwargs):
        return None

    def require_serving(self, model_id, region):
        return None

    def suspect(self):
        return None


@pytest.fixture
def setup(tmp_path):
    tiers = {
        "standard": Tier(requests_per_minute=600, tokens_per_minute=1_000_000, priority=30),
        "dev": Tier(requests_per_minute=600, tokens_per_minute=1_000_000),
    }
    auth = authenticator(tmp_path, tiers=tiers)
    engine = FakeEngine()
    fake = SimpleNamespace(
        auth=auth, region="local", replica="r1", models={MODEL: None}, streaming={MODEL: engine},
        states=_States(), in_flight=InFlight([SimpleNamespace(id=MODEL, max_ongoing_requests=4, max_queued_requests=4)]), max_model_len={MODEL: 8192},
        responses=ResponsesAPI(ResponseStore(auth.keys.database, ResponsesArgs())),
        forwarder=SimpleNamespace(peers=[]),
        meter=Meter(UsageStore(auth.keys.database), tmp_path / "spool", region="local", writer_id="r1", cache_ttl_s=0),
    )
    for name in ("_caller", "_resolve", "_fail_over"):
        setattr(fake, name, getattr(ROUTER, name).__get__(fake))
    app = api_app()
    for path, handler in (
        ("/v1/messages", ROUTER.messages), ("/v1/messages/count_tokens", ROUTER.count_tokens),
        ("/v1/responses", ROUTER.create_response),
    ):
        app.post(path)(_bind(handler, fake))
    app.get("/v1/responses/{response_id}")(_bind_id(ROUTER.retrieve_response, fake))
    app.delete("/v1/responses/{response_id}")(_bind_id(ROUTER.delete_response, fake))
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    other, _ = auth.keys.create_key(owner="bob", tier="standard")
    return SimpleNamespace(client=TestClient(app), engine=engine, key=key, other=other, meter=fake.meter)


def _bind(handler, fake):
    async def route(request: Request):
        return await handler(fake, request)

    return route


def _bind_id(handler, fake):
    async def route(response_id: str, request: Request):
        return await handler(fake, response_id, request)

    return route


HI = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def _anthropic_error(response) -> tuple[int, str]:
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return response.status_code, body["error"]["type"]


def test_messages_take_x_api_key_and_bearer_and_refuse_both(setup):
    assert setup.client.post("/v1/messages", json=HI, headers={"x-api-key": setup.key}).status_code == 200
    assert setup.client.post("/v1/messages", json=HI, headers=bearer(setup.key)).status_code == 200
    both = setup.client.post("/v1/messages", json=HI, headers={"x-api-key": setup.key, **bearer(setup.key)})
    assert _anthropic_error(both) == (400, "invalid_request_error")
    # The engine got the tier's priority beside the body (the replica sets it on the chat request
    # vLLM's Anthropic layer converts to), under the canonical id.
    method, body = setup.engine.bodies[-1]
    assert method == "messages" and body["model"] == MODEL and body["priority"] == 30


def test_every_messages_error_is_in_anthropic_shape(setup):
    cases = [
        ({"x-api-key": "sk-nope"}, HI, (401, "authentication_error")),
        ({}, HI, (401, "authentication_error")),
        ({"x-api-key": setup.key}, {**HI, "max_tokens": 0}, (400, "invalid_request_error")),
        ({"x-api-key": setup.key}, {**HI, "model": "nope"}, (404, "not_found_error")),
        ({"x-api-key": setup.key}, {**HI, "stop_sequences": list("abcde")}, (400, "invalid_request_error")),
    ]
    for headers, body, expected in cases:
        assert _anthropic_error(setup.client.post("/v1/messages", json=body, headers=headers)) == expected
    refused = setup.client.post("/v1/messages", json={**HI, "max_tokens": 0}, headers={"x-api-key": setup.key})
    assert "max_tokens" in refused.json()["error"]["message"]
    assert not [m for m, _ in setup.engine.bodies if m == "messages"]  # none reached the engine


def test_count_tokens_goes_to_the_engine_as_count_tokens(setup):
    body = {k: v for k, v in HI.items() if k != "max_tokens"}
    assert setup.client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": setup.key}).status_code == 200
    assert setup.engine.bodies[-1][0] == "count_tokens"


def test_previous_response_id_sends_the_whole_conversation_and_echoes_the_id(setup):
    headers = bearer(setup.key)
    first = setup.client.post("/v1/responses", json={"model": MODEL, "input": "My name is Ada."}, headers=headers).json()
    second = setup.client.post(
        "/v1/responses", json={"model": MODEL, "input": "Name?", "previous_response_id": first["id"]}, headers=headers
    ).json()
    _, sent = setup.engine.bodies[-1]
    assert "previous_response_id" not in sent and sent["pg_previous_response_id"] == first["id"]
    assert [item.get("role") for item in sent["input"]] == ["user", "assistant", "user"]
    assert sent["input"][0]["content"] == "My name is Ada." and sent["input"][2]["content"] == "Name?"
    assert sent["input"][1]["content"][0]["text"] == "answer 1"
    assert second["previous_response_id"] == first["id"]
    # The third turn continues from the second: the first exchange is still in it.
    setup.client.post("/v1/responses", json={"model": MODEL, "input": "Again?", "previous_response_id": second["id"]}, headers=headers)
    assert len(setup.engine.bodies[-1][1]["input"]) == 5


def test_stored_responses_belong_to_their_owner(setup):
    created = setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=bearer(setup.key)).json()
    assert setup.client.get(f"/v1/responses/{created['id']}", headers=bearer(setup.key)).json()["id"] == created["id"]
    for attempt in (
        setup.client.get(f"/v1/responses/{created['id']}", headers=bearer(setup.other)),
        setup.client.delete(f"/v1/responses/{created['id']}", headers=bearer(setup.other)),
        setup.client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": created["id"]},
                          headers=bearer(setup.other)),
    ):
        assert attempt.status_code == 404 and attempt.json()["error"]["code"] == "response_not_found"
    deleted = setup.client.delete(f"/v1/responses/{created['id']}", headers=bearer(setup.key)).json()
    assert deleted == {"id": created["id"], "object": "response", "deleted": True}
    assert setup.client.get(f"/v1/responses/{created['id']}", headers=bearer(setup.key)).status_code == 404


def test_store_false_keeps_nothing(setup):
    created = setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": False}, headers=bearer(setup.key)).json()
    assert setup.client.get(f"/v1/responses/{created['id']}", headers=bearer(setup.key)).status_code == 404


def test_an_unknown_previous_response_id_is_404_before_the_engine(setup):
    calls = setup.engine.count
    missing = setup.client.post(
        "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, headers=bearer(setup.key)
    )
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
    assert setup.engine.count == calls


def _recorded(setup):
    """What the router's ledger holds, written as the background writer would."""
    asyncio.run(setup.meter.ledger.flush())
    with setup.meter.store.database.connect() as db:
        return [dict(row) for row in db.execute("SELECT * FROM usage_records ORDER BY started_at_ms").fetchall()]


def test_each_admitted_request_is_recorded_once_with_the_engines_tokens(setup):
    assert setup.client.post("/v1/messages", json=HI, headers={"x-api-key": setup.key}).status_code == 200
    assert setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=bearer(setup.key)).status_code == 200
    counted = {k: v for k, v in HI.items() if k != "max_tokens"}
    assert setup.client.post("/v1/messages/count_tokens", json=counted, headers={"x-api-key": setup.key}).status_code == 200
    refused = setup.client.post("/v1/messages", json={**HI, "max_tokens": 0}, headers={"x-api-key": setup.key})
    assert refused.status_code == 400
    rows = _recorded(setup)
    # Counting tokens generates none and a refused body never reached the engine: two rows.
    assert [(r["route"], r["status"], r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"]) for r in rows] == [
        ("/v1/messages", 200, 7, 3, 2), ("/v1/responses", 200, 7, 3, 2),
    ]
    assert {(r["owner"], r["region"], r["model"], r["failover_origin"]) for r in rows} == {("alice", "local", MODEL, None)}
    assert len({r["id"] for r in rows}) == 2


def test_a_request_forwarded_here_names_the_region_it_came_from(setup):
    headers = {**bearer(setup.key), "x-pg-forwarded-from": "yul-02"}
    assert setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=headers).status_code == 200
    (row,) = _recorded(setup)
    assert (row["region"], row["failover_origin"]) == ("local", "yul-02")


def test_a_spent_budget_is_a_429_with_its_reset_in_anthropic_shape_too(setup):
    key_id = setup.key.split("_")[1]
    setup.meter.store.set_budget(key_id, tokens_per_day=10, tokens_per_month=None)
    first = setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=bearer(setup.key))
    assert first.status_code == 200
    assert (first.headers["x-budget-limit-tokens-day"], first.headers["x-budget-remaining-tokens-day"]) == ("10", "10")
    # Ten tokens spent (7 + 3), not yet written: the router counts its own pending records.
    refused = setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=bearer(setup.key))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-budget-remaining-tokens-day"] == "0"
    anthropic = setup.client.post("/v1/messages", json=HI, headers={"x-api-key": setup.key})
    assert _anthropic_error(anthropic) == (429, "rate_limit_error")
    assert len(_recorded(setup)) == 1  # refused requests cost nothing and are not recorded


def test_a_forwarded_request_this_region_could_not_serve_is_left_to_the_forwarding_region(setup):
    from serve_app.router.relay import Exchange

    principal = SimpleNamespace(key_id="k1", owner="alice")
    for origin, status, replica, recorded in (("yul-02", 503, None, 0), ("yul-02", 503, "m1", 1), (None, 503, None, 1)):
        exchange = Exchange("/v1/chat/completions", {}, region="local", replica="r1")
        exchange.record.model, exchange.record.model_replica = MODEL, replica
        exchange.bill = setup.meter.biller(principal, origin=origin)
        exchange.fail(status, "overloaded")
        assert len(_recorded(setup)) == recorded
        with setup.meter.store.database.connect() as db:
            db.execute("DELETE FROM usage_records")
