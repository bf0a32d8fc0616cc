"""Stored responses as a hostile tenant meets them (issue 22, "Stored responses"): through the
routes (a client-chosen id, oversized metadata) and through ``ResponsesAPI`` across two regions'
routers on one registry (issue 23: a response a peer stored is readable at the origin)."""

import asyncio
import json
import logging

import pytest

from auth_support import bearer
from serve_app.auth.database import open_database
from serve_app.auth.principal import Principal
from serve_app.config import ResponsesArgs
from serve_app.errors import APIError
from serve_app.router.response_store import ResponseStore
from serve_app.router.responses import ResponsesAPI
from test_agent_routes import MODEL, setup  # noqa: F401  (setup: the routes on a fake engine)


def test_owner_b_cannot_take_over_owner_as_response_id(setup):
    # The fake engine, as vLLM, names a Response by its request id: the router's (``wire.Call``).
    alices = setup.client.post("/v1/responses", json={"model": MODEL, "input": "my plan"}, headers=bearer(setup.key)).json()
    calls = setup.engine.count

    taken = setup.client.post(
        "/v1/responses", json={"model": MODEL, "input": "x", "request_id": alices["id"]}, headers=bearer(setup.other)
    )

    assert taken.status_code == 400 and taken.json()["error"]["param"] == "request_id"
    assert setup.engine.count == calls  # refused before the engine
    kept = setup.client.get(f"/v1/responses/{alices['id']}", headers=bearer(setup.key))
    assert kept.status_code == 200
    assert kept.json() == {k: v for k, v in alices.items() if k != "pg_metadata"}  # as stored: alice's own


def test_metadata_past_openais_limits_is_refused_before_anything_is_stored(setup):
    calls = setup.engine.count
    for metadata in ({"k": "x" * (938 * 1024)}, {f"k{i}": "v" for i in range(17)}, {"k": "\ud800"}):
        body = json.dumps({"model": MODEL, "input": "hi", "metadata": metadata})  # a lone surrogate as \ud800
        refused = setup.client.post(
            "/v1/responses", content=body, headers={**bearer(setup.key), "content-type": "application/json"}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("metadata")
    assert setup.engine.count == calls


# --- ResponsesAPI on one registry, as two regions' routers ------------------------------------------
ALICE = Principal("k1", "alice", frozenset({"*"}), frozenset({"*"}), frozenset(), "standard", "api_key")
BOB = Principal("k2", "bob", frozenset({"*"}), frozenset({"*"}), frozenset(), "standard", "api_key")


@pytest.fixture(params=["sqlite", "postgres"])
def regions(request, tmp_path):
    """The origin's and a peer's ResponsesAPI, each with its own store on the one registry."""
    location = tmp_path / "keys.sqlite3" if request.param == "sqlite" else request.getfixturevalue("fresh_database")
    database = open_database(location, create=True)
    return ResponsesAPI(ResponseStore(database, ResponsesArgs())), ResponsesAPI(ResponseStore(database, ResponsesArgs()))


def _json(response) -> dict:
    """A GET's answer: the stored JSON, as stored."""
    assert response.media_type == "application/json"
    return json.loads(response.body)


def _answer(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "status": "completed", "created_at": 1,
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}]}


async def _serve(api: ResponsesAPI, caller: Principal, response_id: str, **body) -> int:
    """One request's conversation and keeping, as the inference path runs them."""
    body = {"model": MODEL, "input": "hello", **body}
    keep, _ = await api.continue_from(body, caller)
    return await keep(_answer(response_id))


def test_a_response_a_peer_region_stored_is_the_owners_at_the_origin_and_nobody_elses(regions):
    origin, peer = regions

    async def scenario():
        stored = await _serve(peer, ALICE, "resp_failed_over")  # served by the peer after a failover
        assert stored > 0  # the bytes the request's usage record counts
        assert _json(await origin.retrieve("resp_failed_over", ALICE))["id"] == "resp_failed_over"
        await _serve(origin, ALICE, "resp_next", previous_response_id="resp_failed_over")
        for attempt in (
            origin.retrieve("resp_failed_over", BOB),
            origin.delete("resp_failed_over", BOB),
            origin.cancel("resp_failed_over", BOB),
            _serve(origin, BOB, "resp_bobs", previous_response_id="resp_failed_over"),
        ):
            with pytest.raises(APIError) as refused:
                await attempt
            assert refused.value.status == 404 and refused.value.code == "response_not_found"
        assert (await peer.delete("resp_failed_over", ALICE))["deleted"] is True
        with pytest.raises(APIError):
            await origin.retrieve("resp_failed_over", ALICE)

    asyncio.run(scenario())


def test_a_taken_id_is_logged_and_stores_nothing(regions, caplog):
    origin, peer = regions

    async def scenario():
        await _serve(origin, ALICE, "resp_1")
        with caplog.at_level(logging.ERROR, logger="serve_app.router.responses"):
            assert await _serve(peer, BOB, "resp_1") == 0
        assert _json(await origin.retrieve("resp_1", ALICE))["output"][0]["content"][0]["text"] == "hi"
        assert await _serve(origin, ALICE, "resp_2", store=False) == 0  # store: false keeps nothing

    asyncio.run(scenario())
    assert "resp_1 not stored: that id is stored already" in caplog.text


# --- ids no stored response can have, on PostgreSQL (which refuses to look a NUL up) ---------------
def test_an_id_no_response_can_have_is_not_found_and_charged_like_any_unknown_one(router_app, fresh_database,
                                                                                 monkeypatch):
    from fake_engine import FakeEngine

    monkeypatch.setenv("ISOLATION_REGISTRY_DSN", fresh_database)
    app = router_app(engine=FakeEngine(), key_registry_dsn_env="ISOLATION_REGISTRY_DSN")
    app.client._transport.raise_server_exceptions = False
    key, _ = app.auth.keys.create_key(owner="bob", tier="standard")
    for path in ("%00", "resp_%00x", "resp_%C3%A9"):  # a NUL; a NUL inside; not ASCII
        for method, suffix in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
            answer = app.client.request(method, f"/v1/responses/{path}{suffix}", headers=bearer(key))
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "response_not_found"
    tiny, _ = app.auth.keys.create_key(owner="alice", tier="tiny")  # 2 requests a minute
    headers = {**bearer(tiny), "content-type": "application/json"}
    surrogate = '{"model": "%s", "input": "hi", "previous_response_id": "resp_\\ud800"}' % MODEL
    answer = app.client.post("/v1/responses", content=surrogate, headers=headers)  # refused as it is read
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "previous_response_id"
    tiny, _ = app.auth.keys.create_key(owner="alice", tier="tiny")  # that refusal cost one of the two
    headers = {**bearer(tiny), "content-type": "application/json"}
    body = json.dumps({"model": MODEL, "input": "hi", "previous_response_id": "resp_\x00"})
    answers = [app.client.post("/v1/responses", content=body, headers=headers) for _ in range(3)]
    assert [a.json()["error"]["param"] for a in answers[:2]] == ["previous_response_id"] * 2
    assert [a.status_code for a in answers] == [404, 404, 429]  # charged as any unknown id: no free 500s


def test_a_conversation_continued_while_the_store_is_away_is_a_503_to_retry_not_a_500(setup, monkeypatch):
    from serve_app.auth.database import RegistryUnavailable

    async def away(*_):
        raise RegistryUnavailable("cannot reach the key registry at host=db")

    monkeypatch.setattr(setup.app.services.responses.store, "history", away)
    answer = setup.client.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": "resp_1"},
                               headers=bearer(setup.key))
    assert (answer.status_code, answer.json()["error"]["code"]) == (503, "key_registry_unavailable")
    assert answer.headers["retry-after"] and setup.engine.calls == []  # nothing ran on a model


def test_a_key_restricted_to_a_model_sees_none_of_its_owners_responses_of_another(regions):
    """A key for one model could read, delete and continue (its whole conversation repeated into
    that model's prompt) any response its owner stored through another model: each is a 404 now,
    as a response that does not exist; the owner's unrestricted key still has it."""
    origin, _ = regions
    other_model = "qwen-3.5-27b"
    only_the_other = Principal("k3", "alice", frozenset({other_model}), frozenset({"*"}), frozenset(), "standard",
                               "api_key")

    async def scenario():
        await _serve(origin, ALICE, "resp_main")  # stored under MODEL
        for attempt in (
            origin.retrieve("resp_main", only_the_other),
            origin.delete("resp_main", only_the_other),
            origin.cancel("resp_main", only_the_other),
            origin.continue_from({"model": other_model, "input": "go on", "previous_response_id": "resp_main"},
                                 only_the_other),
        ):
            with pytest.raises(APIError) as refused:
                await attempt
            assert refused.value.status == 404 and refused.value.code == "response_not_found"
        assert _json(await origin.retrieve("resp_main", ALICE))["id"] == "resp_main"  # untouched
        restricted_to_it = Principal("k4", "alice", frozenset({MODEL}), frozenset({"*"}), frozenset(), "standard",
                                     "api_key")
        assert _json(await origin.retrieve("resp_main", restricted_to_it))["id"] == "resp_main"

    asyncio.run(scenario())


def test_an_id_no_server_made_is_missing_without_a_query(regions):
    origin, _ = regions
    queries = []
    database = origin.store.database
    connect = database.connect
    database.connect = lambda *a, **kw: queries.append(1) or connect(*a, **kw)

    async def scenario():
        for too_long in ("resp_" + "0" * 124, "resp_" + "x" * (2 << 20)):
            with pytest.raises(APIError) as refused:
                await origin.retrieve(too_long, ALICE)
            assert refused.value.status == 404

    asyncio.run(scenario())
    assert queries == []

