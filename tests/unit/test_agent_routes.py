"""The Responses and Messages routes at the router, on a fake engine (no Ray, no vLLM): the
router's own code path — credential (Bearer or x-api-key), validation, conversations continued
from the region store, ownership, and Anthropic-shaped errors on Anthropic's routes."""

from types import SimpleNamespace

import pytest

from auth_support import MODEL, bearer
from fake_engine import FakeEngine
from serve_app.auth.config import Tier

@pytest.fixture
def setup(router_app):
    tiers = {
        "standard": Tier(requests_per_minute=600, tokens_per_minute=1_000_000, priority=30),
        "dev": Tier(requests_per_minute=600, tokens_per_minute=1_000_000),
    }
    # What the replica's token count says of every generation: 7 prompt tokens (2 of them from
    # the prefix cache), 3 completion tokens.
    app = router_app(engine=FakeEngine(tokens=3, prompt_tokens=7, cached_tokens=2), tiers=tiers)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    other, _ = app.auth.keys.create_key(owner="bob", tier="standard")
    return SimpleNamespace(client=app.client, engine=app.engine, key=key, other=other, meter=app.meter, app=app)


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
    _, call = setup.engine.calls[-1]
    sent = call.body
    assert "previous_response_id" not in sent and call.previous_response_id == first["id"]
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
    return setup.app.recorded()


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


def test_a_request_forwarded_here_names_the_region_it_came_from(tmp_path, router_app):
    """With the forwarding region's failover token (a client's hop header is ignored:
    test_auth_audit.py)."""
    from auth_support import federated_regions
    from serve_app.auth.keys import SCOPE_INFERENCE

    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    here = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=3))
    key, _ = regions["yul-02"].keys.create_key(owner="alice", tier="standard")
    caller = regions["yul-02"].authenticate(f"Bearer {key}", scope=SCOPE_INFERENCE)
    forwarding = regions["yul-02"].forwarding_token(caller, "yvr-01")
    headers = {"Authorization": f"Bearer {forwarding}", "x-pg-forwarded-from": "yul-02"}
    assert here.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=headers).status_code == 200
    assert [(r["region"], r["failover_origin"]) for r in here.recorded()] == [("yvr-01", "yul-02")]


def test_a_spent_budget_is_a_429_with_its_reset_in_anthropic_shape_too(setup):
    key_id = setup.key.split("_")[1]
    setup.meter.store.set_budget(key_id, tokens_per_day=25, tokens_per_month=None)
    # Priced at its prompt (~15 tokens by size) plus its limit of 3: it fits the 25 left.
    small = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
    first = setup.client.post("/v1/responses", json=small, headers=bearer(setup.key))
    assert first.status_code == 200
    assert (first.headers["x-budget-limit-tokens-day"], first.headers["x-budget-remaining-tokens-day"]) == ("25", "25")
    # Ten tokens spent (7 + 3), not yet written: the router counts its own pending records, and
    # the same request's worst case no longer fits the 15 left.
    refused = setup.client.post("/v1/responses", json=small, headers=bearer(setup.key))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-budget-remaining-tokens-day"] == "15"
    anthropic = setup.client.post("/v1/messages", json=HI, headers={"x-api-key": setup.key})
    assert _anthropic_error(anthropic) == (429, "rate_limit_error")
    assert len(_recorded(setup)) == 1  # refused requests cost nothing and are not recorded


def test_a_forwarded_request_this_region_could_not_serve_is_left_to_the_forwarding_region(setup):
    from serve_app.telemetry.timing import RequestRecord

    principal = SimpleNamespace(key_id="k1", owner="alice")
    for origin, status, replica, recorded in (("yul-02", 503, None, 0), ("yul-02", 503, "m1", 1), (None, 503, None, 1)):
        record = RequestRecord.begin("/v1/chat/completions", region="local", replica="r1")
        record.model, record.model_replica = MODEL, replica
        record.finish(status, "overloaded")
        setup.meter.record("r-" + str(recorded) + str(origin), principal, record, None, origin=origin)
        assert len(_recorded(setup)) == recorded
        with setup.meter.store.database.connect() as db:
            db.execute("DELETE FROM usage_records")


def test_a_stored_response_is_counted_in_its_owners_usage(setup):
    kept = setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=bearer(setup.key))
    not_kept = setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi", "store": False},
                                 headers=bearer(setup.key))
    assert kept.status_code == not_kept.status_code == 200
    stored, unstored = _recorded(setup)
    assert stored["stored_bytes"] > len("answer") and unstored["stored_bytes"] == 0


def test_a_follow_up_that_fails_over_is_continued_by_the_peer_from_the_shared_store(tmp_path, router_app):
    """Regions share the Responses store (the registry's database): a follow-up this region cannot
    serve goes to the peer as the client sent it, previous_response_id and its own input, and the
    peer recalls the conversation and echoes the id (it used to lose both)."""
    import httpx

    from auth_support import federated_regions
    from serve_app.auth.keys import SCOPE_INFERENCE
    from router_app import to_router
    from serve_app.config import Peer

    regions = federated_regions(tmp_path / "keys", "yul-02", "yvr-01")
    peer = router_app(auth=regions["yvr-01"], region="yvr-01", engine=FakeEngine(tokens=3))
    home = router_app(auth=regions["yul-02"], region="yul-02", engine=FakeEngine(tokens=3),
                      peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(to_router(peer)))
    key, _ = home.auth.keys.create_key(owner="alice", tier="standard")
    first = home.client.post("/v1/responses", json={"model": MODEL, "input": "My name is Ada."}, headers=bearer(key))
    assert first.status_code == 200, first.text
    first = first.json()
    peer.services.responses = home.services.responses  # one store, as one registry database gives every region
    home.serve.stop(MODEL)  # from now on this region cannot serve it
    home.run(home.services.states.refresh)
    follow_up = home.client.post(
        "/v1/responses", json={"model": MODEL, "input": "Name?", "previous_response_id": first["id"]}, headers=bearer(key)
    )
    assert follow_up.status_code == 200 and follow_up.headers["x-pg-region"] == "yvr-01"
    assert follow_up.json()["previous_response_id"] == first["id"]
    (_, call), = peer.engine.calls
    assert [item.get("role") for item in call.body["input"]] == ["user", "assistant", "user"]  # the history, once
