"""A ``serve deploy`` that changes the router's settings reaches the running router replicas as a
new ``user_config`` (``Router.reconfigure``, ``Services.reconfigure``): applied in place, while
requests run, without losing what the replica holds. The real router on a fake engine
(``router_app.py``); Serve's call of ``reconfigure`` is made here directly."""

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from auth_support import MODEL, OTHER_MODEL, bearer
from fake_engine import FakeEngine
from router_app import InProcessHandle
from serve_app.config import AppArgs
from serve_app.regions.layout import merge_settings, split_startup
from serve_app.router import ingress

CHAT = "/v1/chat/completions"


def _settings(args: AppArgs) -> tuple[dict, dict]:
    """The router's args and user_config for ``args``, as the layout splits them."""
    return split_startup(args.model_dump(mode="json", exclude_unset=True))


def _changed(app, change) -> AppArgs:
    startup, settings = _settings(app.services.args)
    change(settings)
    return AppArgs.model_validate(merge_settings(startup, settings))


def _stream_lines(response):
    return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_a_settings_change_mid_stream_is_applied_in_place_and_the_stream_finishes(router_app):
    engine = FakeEngine(tokens=40, latency_s=0.02)
    app = router_app(engine=engine, models=(MODEL,))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    before = {name: getattr(app.services, name) for name in ("auth", "meter", "forwarder", "responses", "states", "in_flight")}
    added = []

    def handle_for(model_id):
        """Serve's handle to the model's deployment, whose ``options(stream=True)`` the router calls."""
        added.append(model_id)
        return SimpleNamespace(options=lambda stream: InProcessHandle(app.handles[MODEL].server))

    def change(settings):
        settings["auth"]["cache_ttl_s"] = 2
        settings["auth"]["tiers"]["standard"]["requests_per_minute"] = 700
        settings["failover"] = {"peers": [{"region": "peer", "endpoint": "http://127.0.0.1:9/peer"}], "connect_timeout_s": 1}
        settings["responses"] = {"retention_hours": 1}
        settings["usage"] = {"flush_interval_s": 0.5}
        settings["models"].append({"id": OTHER_MODEL, "default_max_tokens": 64})

    body = {"model": MODEL, "max_tokens": 40, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with app.client.stream("POST", CHAT, json=body, headers=bearer(key)) as response:
        lines = iter(response.iter_lines())
        first = next(line for line in lines if line.startswith("data: "))  # the stream is under way
        assert app.services.in_flight.load(MODEL, 1)["in_flight"] == 1
        changed = app.run(app.services.reconfigure, _changed(app, change), handle_for)
        assert app.services.in_flight.load(MODEL, 1)["in_flight"] == 1  # its count survived
        rest = [line for line in lines if line.startswith("data: ")]
    assert response.status_code == 200 and json.loads(first[6:])["choices"]
    assert rest[-1] == "data: [DONE]" and engine.closed_early == 0  # finished, nothing aborted
    assert sorted(changed) == ["auth", "failover", "models", "responses", "usage"]

    services = app.services
    # Rebuilt: the authenticator (its key cache and keyset view), on the same rate limiter; the
    # new one lists the registry's key ids, the old one's listing and read-ahead threads stopped.
    assert services.auth is not before["auth"] and services.auth.limiter is before["auth"].limiter
    assert services.auth._following and not any(task.done() for task in services.auth._following)
    assert not before["auth"].keys._refresher.reserve()
    assert services.auth.args.tiers["standard"].requests_per_minute == 700
    # Re-set in place: the ledger (its pending records), the stored responses, the peers.
    for name in ("meter", "forwarder", "responses", "states", "in_flight"):
        assert getattr(services, name) is before[name], name
    assert services.meter.budgets.cache_ttl_s == 2 and services.meter.ledger.flush_interval_s == 0.5
    assert services.responses.store.retention_ms == 3_600_000
    assert [p.region for p in services.forwarder.peers] == ["peer"]
    # The model that joined has a handle (asked for once) and is listed and served.
    assert added == [OTHER_MODEL]
    assert services.models[OTHER_MODEL].default_max_tokens == 64
    listed = app.client.get("/v1/models", headers=bearer(key)).json()["data"]
    assert {card["id"] for card in listed} == {MODEL, OTHER_MODEL}
    # The request that ran across the change is billed once, by the meter that outlived it.
    (row,) = app.recorded()
    assert (row["status"], row["completion_tokens"]) == (200, 40)
    again = app.client.post(CHAT, json={**body, "stream": False, "max_tokens": 4}, headers=bearer(key))
    assert again.status_code == 200, again.text


def test_a_model_the_settings_no_longer_list_is_not_served_but_its_requests_finish(router_app):
    engine = FakeEngine(tokens=30, latency_s=0.02)
    app = router_app(engine=engine)
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": OTHER_MODEL, "max_tokens": 30, "stream": True, "messages": [{"role": "user", "content": "hi"}]}

    def without_other(settings):
        settings["models"] = [m for m in settings["models"] if m["id"] != OTHER_MODEL]

    with app.client.stream("POST", CHAT, json=body, headers=bearer(key)) as response:
        lines = iter(response.iter_lines())
        next(line for line in lines if line.startswith("data: "))
        app.run(app.services.reconfigure, _changed(app, without_other), lambda model_id: pytest.fail("no new handle"))
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    gone = app.client.post(CHAT, json={**body, "stream": False}, headers=bearer(key))
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "model_not_found")
    listed = app.client.get("/v1/models", headers=bearer(key)).json()["data"]
    assert [card["id"] for card in listed] == [MODEL]
    health = app.client.get("/health").json()
    assert set(health["models"]) == {MODEL}


def test_a_wrong_task_refusal_lists_only_the_models_served_now(router_app):
    embed = "qwen-3-embedding-0.6b"
    app = router_app(models=(MODEL, embed))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")

    def without_embed(settings):
        settings["models"] = [m for m in settings["models"] if m["id"] != embed]

    app.run(app.services.reconfigure, _changed(app, without_embed), lambda model_id: pytest.fail("no new handle"))
    refused = app.client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"}, headers=bearer(key)).json()
    assert refused["error"]["code"] == "model_does_not_serve_route"
    assert refused["error"]["message"].endswith("models of task 'embed' here: none")


def test_an_auth_change_keeps_the_listed_key_ids_so_real_keys_are_never_budgeted_as_made_up(router_app,
                                                                                             monkeypatch):
    from serve_app.auth.keys import KeyStore

    app = router_app(registry_miss_lookups_per_s=1)
    keys = [app.auth.keys.create_key(owner=f"owner-{i}", tier="standard")[0] for i in range(5)]
    app.run(app.auth.list_key_ids)  # as the replica does before its first request
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}

    def listing_away(self):
        raise ConnectionError("the registry's listing did not answer")

    monkeypatch.setattr(KeyStore, "refresh_known_ids", listing_away)  # the new store lists nothing itself

    def tier_raised(settings):
        settings["auth"]["tiers"]["standard"]["requests_per_minute"] = 700

    app.run(app.services.reconfigure, _changed(app, tier_raised), lambda model_id: pytest.fail("no new handle"))
    statuses = [app.client.post(CHAT, json=body, headers=bearer(key)).status_code for key in keys]
    assert statuses == [200] * 5  # not 503 key_registry_busy past the made-up ids' 1 lookup a second


def test_settings_read_at_start_are_refused_in_place(router_app):
    """Serve never sends them this way (they are the router application's args, whose change
    restarts the replica); Services refuses them rather than half-apply them."""
    app = router_app()
    moved = app.services.args.model_copy(update={"region": "elsewhere"})
    with pytest.raises(ValueError, match="read when a router replica starts"):
        app.run(app.services.reconfigure, moved, lambda model_id: None)
    assert app.services.region == "local"


ROUTER = ingress.Router.func_or_class  # the replica's class; its methods run on a stand-in here


def _router(app) -> SimpleNamespace:
    """A Router replica's state, as its __init__ and first reconfigure leave it, on this app."""
    startup, _ = _settings(app.services.args)
    return SimpleNamespace(app_name="llm", replica="router-1", startup=startup, services=app.services,
                           handle=lambda model_id: pytest.fail("no new model here"))


def test_an_invalid_user_config_leaves_the_running_router_as_it_was(router_app, caplog):
    """Raising would make Serve stop the replica, and its replacement would fail the same way:
    the region would lose its routers for a typo. The replica keeps serving and says why."""
    app = router_app()
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    router = _router(app)
    auth = app.services.auth
    _, settings = _settings(app.services.args)
    caplog.set_level(logging.ERROR)
    app.run(ROUTER.reconfigure, router, {**settings, "failover": {"max_attempts": 0}})
    app.run(ROUTER.reconfigure, router, {**settings, "auht": {}})
    assert app.services.auth is auth
    assert [r.levelno for r in caplog.records if "user_config is invalid" in r.getMessage()] == [logging.ERROR] * 2
    assert "failover.max_attempts" in caplog.text and "auht" in caplog.text
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert app.client.post(CHAT, json=chat, headers=bearer(key)).status_code == 200


def test_a_user_config_refused_for_a_passing_reason_is_applied_once_it_can_be(router_app, monkeypatch, caplog):
    """Serve sends a config once: a replica that could not apply it would serve the old one until
    the next deploy while the region's other routers serve the new one."""
    from serve_app.router import services as services_module

    app = router_app()
    router = _router(app)
    _, settings = _settings(app.services.args)
    real = services_module.Authenticator
    refusals = []

    def registry_away_once(*args, **kwargs):
        if not refusals:
            refusals.append(1)
            raise ConnectionError("the key registry did not answer")
        return real(*args, **kwargs)

    monkeypatch.setattr(services_module, "Authenticator", registry_away_once)
    monkeypatch.setattr(ingress, "RETRY_FIRST_S", 0.05)
    raised = {**settings, "auth": {**settings["auth"], "cache_ttl_s": 7}}

    async def scenario():
        await ROUTER.reconfigure(router, raised)
        assert app.services.args.auth.cache_ttl_s != 7 and router.retrying is not None  # refused, to be tried again
        await asyncio.wait_for(router.retrying, 10)
        assert app.services.args.auth.cache_ttl_s == 7

    caplog.set_level(logging.ERROR)
    app.run(scenario)
    assert "trying again" in caplog.text


def test_a_newer_user_config_supersedes_one_being_tried_again(router_app, monkeypatch):
    from serve_app.router import services as services_module

    app = router_app()
    router = _router(app)
    _, settings = _settings(app.services.args)
    real = services_module.Authenticator
    away = {"on": True}

    def registry(*args, **kwargs):
        if away["on"]:
            raise ConnectionError("the key registry did not answer")
        return real(*args, **kwargs)

    monkeypatch.setattr(services_module, "Authenticator", registry)
    monkeypatch.setattr(ingress, "RETRY_FIRST_S", 60.0)

    async def scenario():
        await ROUTER.reconfigure(router, {**settings, "auth": {**settings["auth"], "cache_ttl_s": 7}})
        first = router.retrying
        away["on"] = False
        await ROUTER.reconfigure(router, {**settings, "auth": {**settings["auth"], "cache_ttl_s": 9}})
        await asyncio.sleep(0)
        assert first.cancelled() and router.retrying is None and app.services.args.auth.cache_ttl_s == 9

    app.run(scenario)


def test_a_router_without_a_user_config_fails_its_health_check_and_says_where_settings_go():
    with pytest.raises(RuntimeError, match="no user_config"):
        asyncio.run(ROUTER.check_health(SimpleNamespace(services=None)))


def test_the_first_user_config_must_be_valid():
    """A replica that starts on bad settings fails to start (Serve keeps the old ones serving
    while a replacement fails: the deployment surges)."""
    with pytest.raises(ValueError, match="models"):
        asyncio.run(ROUTER.reconfigure(SimpleNamespace(services=None, startup={"region": "local"}), {"auth": {}}))


def test_a_peer_listed_while_a_request_fails_over_is_not_asked_without_a_token(router_app):
    """A deploy that adds a peer while a failing-over request mints its tokens: that request
    walks the peers it minted for (the new one was a KeyError, a 500, before)."""
    import httpx

    from serve_app.config import Peer
    from serve_app.router.failover import Forwarder

    asked = []

    def peers(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        return httpx.Response(503, json={"error": {"message": "overloaded", "code": "overloaded"}})

    app = router_app(engine=FakeEngine(tokens=3), peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                     transport=httpx.MockTransport(peers))
    forwarder: Forwarder = app.services.forwarder
    minting = app.services.auth.forwarding_token

    def mint_while_a_deploy_lands(caller, region):
        forwarder.apply([*forwarder.peers, Peer(region="fra-01", endpoint="https://fra.test")], connect_timeout_s=2,
                        read_timeout_s=5, max_attempts=2, unreachable_hold_s=0)
        return minting(caller, region)

    app.services.auth.forwarding_token = mint_while_a_deploy_lands
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    app.serve.stop(MODEL)
    app.run(app.services.states.refresh)
    refused = app.client.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                              headers=bearer(key))
    assert refused.status_code == 503, refused.text
    assert asked == ["yvr.test"]
    assert [p.region for p in forwarder.peers] == ["yvr-01", "fra-01"]  # the next request asks both
