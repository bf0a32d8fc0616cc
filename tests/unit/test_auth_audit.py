"""The auth audit's findings (issue #14, "Build" item 4), one test or more each: every test here
failed before its fix. The router's own methods run against small fakes (no Ray, no Serve)."""

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import jwt
import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from serve_app.auth import lease as lease_module
from serve_app.auth import tokens
from serve_app.auth.authenticator import FORWARDING_TOKEN_TTL_S, Authenticator, region_audience
from serve_app.auth.config import AuthArgs
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, parse_key
from serve_app.auth.lease import LeasedRateLimiter
from serve_app.auth.ratelimit import LocalRateLimiter, RateLimiter, SharedRateLimiter
from serve_app.errors import APIError
from serve_app.router import ingress, openapi
from serve_app.config import Peer
from serve_app.router.failover import HOP_HEADER, Forwarder
from tests.unit.auth_support import (
    MODEL,
    OTHER_MODEL,
    api_app,
    auth_args,
    authenticator,
    bearer,
    chat,
    claims,
    current_key,
    federated_regions,
    sign,
)
from router_app import router_client
from serve_app.telemetry import metrics as telemetry_metrics
from test_telemetry import fake_metrics


def _claims_of(token: str) -> dict:
    return jwt.decode(token, options={"verify_signature": False})


def _mint(client: TestClient, key: str) -> str:
    response = client.post("/v1/auth/token", json={"api_key": key})
    assert response.status_code == 200, response.text
    return response.json()["access_token"]


def _error(response) -> tuple[int, str, str | None]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return response.status_code, error["code"], error["param"]


# --- 1. keys are matched in full ---------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["\n", "\r\n", " ", "\n\n"])
def test_a_key_with_anything_after_it_is_not_a_key(tmp_path, suffix):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    assert parse_key(key + suffix) is None
    refused = client.post("/v1/auth/token", json={"api_key": key + suffix})
    assert _error(refused)[:2] == (401, "invalid_api_key")
    assert client.post("/v1/auth/token", json={"api_key": key}).status_code == 200


# --- 2. the published schema leaves the admin routes out ----------------------------------------
def test_the_public_openapi_schema_lists_no_admin_route_and_keeps_the_rest():
    schema = openapi.build(ingress.app)
    paths = set(schema["paths"])
    assert not [p for p in paths if p.startswith("/v1/admin/") or p in ("/v1/models/load", "/v1/models/unload")]
    served = {route.path for route in ingress.app.routes}
    assert {"/v1/models/load", "/v1/models/unload", "/v1/admin/keys"} <= served  # still served
    # The rest is as before: request bodies, OpenAI-shaped errors, never FastAPI's 422.
    chat_op = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat_op["requestBody"]["required"] is True
    assert "429" in chat_op["responses"] and "422" not in chat_op["responses"]
    token_op = schema["paths"]["/v1/auth/token"]["post"]
    assert token_op["requestBody"]["required"] is False
    assert "ModelRequest" not in schema["components"]["schemas"]
    assert not {"HTTPValidationError", "ValidationError"} & set(schema["components"]["schemas"])
    assert "admin" not in json.dumps(schema["paths"])


# --- 3. load / unload are an operator's --------------------------------------------------------
@pytest.mark.parametrize("models, regions", [((MODEL,), ("*",)), (("*",), ("local",)), (("*",), ("*",))])
def test_an_owner_admin_cannot_load_or_unload_a_model_every_owner_shares(tmp_path, router_app, models, regions):
    """An admin without the operator scope is an owner's (docs/auth.md, "Admin scopes"), however
    wide its models and regions; the model serves every owner in the region: unloading it, even
    its own, would take it from all."""
    auth = authenticator(tmp_path)
    app = router_app(auth=auth)
    owner_admin, _ = auth.keys.create_key(owner="acme", tier="standard", models=models, regions=regions,
                                          scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    for action in ("unload", "load"):
        refused = app.client.post(f"/v1/models/{action}", json={"model": MODEL}, headers=bearer(owner_admin))
        assert _error(refused)[:2] == (403, "insufficient_scope")
    assert app.serve.kv == {}  # nothing was written
    operator, record = auth.keys.create_key(owner="ops", tier="standard",
                                            scopes=(SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR))
    allowed = app.client.post("/v1/models/unload", json={"model": MODEL}, headers=bearer(operator))
    assert allowed.status_code in (200, 202), allowed.text
    assert [(deployment, r.state, r.by) for (_, deployment), r in app.serve.kv.items()] == [
        (f"model-{MODEL}", "cold", record.key_id)
    ]


# --- 4. token lifetime is capped; imported kids carry no admin ----------------------------------
def test_a_token_living_longer_than_the_configured_ttl_is_refused_however_well_signed(tmp_path):
    auth = authenticator(tmp_path)  # token_ttl_s 900, leeway_s 30
    client = router_client(auth)
    key, now = current_key(auth), int(time.time())
    ten_years = sign(key, claims(auth, iat=now, nbf=now, exp=now + 10 * 365 * 86400))
    refused = chat(client, ten_years)
    assert _error(refused)[:2] == (401, "invalid_token")
    assert "lifetime" in refused.json()["error"]["message"]
    assert chat(client, sign(key, claims(auth, iat=now, nbf=now, exp=now + 900 + 30))).status_code == 200
    assert chat(client, sign(key, claims(auth, iat=now, nbf=now, exp=now + 900 + 31))).status_code == 401
    # A backdated iat does not stretch it either, and exp/iat must be real numbers.
    assert chat(client, sign(key, claims(auth, iat=now - 20, nbf=now - 20, exp=now + 900 + 20))).status_code == 401
    assert chat(client, sign(key, claims(auth, iat=str(now), exp=now + 60))).status_code == 401


def test_the_cap_is_on_by_default_for_every_verifier(tmp_path):
    auth = authenticator(tmp_path)
    now = int(time.time())
    long_lived = sign(current_key(auth), claims(auth, iat=now, nbf=now, exp=now + 86400))
    with pytest.raises(tokens.TokenError, match="lifetime"):
        tokens.verify(long_lived, auth.keyset, issuer=auth.args.issuer, audience=auth.args.audience, leeway_s=0)


def test_imported_kids_are_bound_to_their_region_and_carry_no_admin_scope(tmp_path):
    regions = federated_regions(tmp_path, "yul-02", "yvr-01")
    yul, yvr = regions["yul-02"], regions["yvr-01"]
    admin_key, _ = yul.keys.create_key(owner="ops", tier="standard", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    token = _mint(router_client(yul), admin_key)
    assert router_client(yul).get("/v1/admin/keys", headers=bearer(token)).status_code == 200
    # The same token, or one forged with yul's key (a compromised region), is no admin in yvr.
    yvr_client = router_client(yvr)
    now = int(time.time())
    forged = sign(yul.keyset.current().signing_key(), claims(yvr, iat=now, nbf=now, exp=now + 300))
    for credential in (token, forged):
        refused = yvr_client.get("/v1/admin/keys", headers=bearer(credential))
        assert _error(refused)[:2] == (403, "insufficient_scope")
        assert "region that signed" in refused.json()["error"]["message"]
        assert chat(yvr_client, credential).status_code == 200  # inference is still honoured
    own = sign(yvr.keyset.current().signing_key(), claims(yvr, iat=now, nbf=now, exp=now + 300))
    assert yvr_client.get("/v1/admin/keys", headers=bearer(own)).status_code == 200
    imported = [k for k in yvr.keyset.current().keys if k.imported]
    assert [k.region for k in imported] == ["yul-02"]  # kid → the region that issued it
    operator_key, _ = yul.keys.create_key(owner="ops", tier="standard",
                                          scopes=(SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR))
    operator_token = _mint(router_client(yul), operator_key)
    assert yul.authenticate(f"Bearer {operator_token}", scope=SCOPE_ADMIN).scopes == {
        SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR}
    assert yvr.authenticate(f"Bearer {operator_token}", scope=SCOPE_INFERENCE).scopes == {SCOPE_INFERENCE}


def test_a_region_publishes_its_own_keys_only_so_trust_is_never_passed_on(tmp_path):
    """fra imports yvr only; yvr imported yul. What yvr publishes must not make yul's tokens
    verify in fra (nor keep a key yul removed alive in yvr's JWKS)."""
    regions = federated_regions(tmp_path, "yul-02", "yvr-01")
    yul, yvr = regions["yul-02"], regions["yvr-01"]
    own = {key.kid for key in yvr.keyset.current().keys if not key.imported}
    assert {jwk["kid"] for jwk in yvr.jwks()["keys"]} == own
    assert {jwk["kid"] for jwk in tokens.load_keyset(yvr.keyset.path).jwks()["keys"]} == own  # `export-jwks`
    fra = authenticator(tmp_path / "fra", region="fra-01", dev_api_key_env=None,
                        key_store_path=str(tmp_path / "registry.sqlite3"))
    tokens.save_keyset(fra.keyset.path, tokens.load_keyset(fra.keyset.path).with_imported(yvr.jwks()))
    fra.keyset = tokens.KeysetFile(fra.keyset.path, check_interval_s=0)
    key, _ = yul.keys.create_key(owner="alice", tier="standard")
    from_yul, from_yvr = (_mint(router_client(region), key) for region in (yul, yvr))
    assert chat(router_client(fra), from_yvr).status_code == 200
    refused = chat(router_client(fra), from_yul)
    assert _error(refused)[:2] == (401, "invalid_token")


def test_a_jwks_without_region_names_still_imports_as_foreign(tmp_path):
    yul = authenticator(tmp_path, region="yul-02", dev_api_key_env=None)
    # What `serve-app signing export-jwks` prints today: no region names.
    bare = tokens.load_keyset(yul.keyset.path).jwks()
    assert "region" not in bare["keys"][0]
    keyset = tokens.Keyset((tokens.SigningKey.generate(),)).with_imported(bare)
    (imported,) = [k for k in keyset.keys if k.imported]
    assert imported.region is None
    named = tokens.Keyset((tokens.SigningKey.generate(),)).with_imported(bare, region="yul-02")
    assert [k.region for k in named.keys if k.imported] == ["yul-02"]


# --- 5. failover mints a short token for the peer alone -----------------------------------------
def _fail_over(router_app, yul: Authenticator, credential: str, peers: list[Peer], answers):
    """A chat the region cannot serve (its model is loading), failed over to ``peers`` answering
    ``answers(request)``: the requests the peers saw, and the router."""
    seen: list[httpx.Request] = []

    def peer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers(request)

    app = router_app(auth=yul, region=yul.region, peers=tuple(peers), transport=httpx.MockTransport(peer))
    app.serve.stop(MODEL)
    app.run(app.services.states.refresh)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    app.client.post("/v1/chat/completions", json=body, headers={"Authorization": credential})
    return seen, app


@pytest.mark.parametrize("via", ["token", "api_key"])
def test_failover_sends_each_peer_a_minute_long_token_for_that_peer_only(tmp_path, router_app, via):
    regions = federated_regions(tmp_path, "yul-02", "yvr-01", "yyz-01")
    yul = regions["yul-02"]
    key, record = yul.keys.create_key(owner="alice", tier="standard")
    client_token = _mint(router_client(yul), key)
    credential = f"Bearer {client_token if via == 'token' else key}"
    peers = [Peer(region="yvr-01", endpoint="https://yvr.test"), Peer(region="yyz-01", endpoint="https://yyz.test")]
    # yvr is overloaded too (503), yyz serves: both are tried, each with its own token.
    seen, _ = _fail_over(
        router_app, yul, credential, peers, lambda r: httpx.Response(503 if r.url.host == "yvr.test" else 200, json={})
    )
    assert [r.url.host for r in seen] == ["yvr.test", "yyz.test"]
    # The limit under the client's own name (pricing renames chat's max_tokens here).
    assert all(json.loads(r.content)["max_tokens"] == 4 and "max_completion_tokens" not in json.loads(r.content)
               for r in seen)
    for request, region in zip(seen, ["yvr-01", "yyz-01"]):
        sent = request.headers["authorization"]
        assert sent != credential and client_token not in sent and key not in sent
        forwarded = sent.removeprefix("Bearer ")
        payload = _claims_of(forwarded)
        assert payload["aud"] == region_audience(yul.args.audience, region)
        assert payload["exp"] - payload["iat"] <= FORWARDING_TOKEN_TTL_S
        assert payload["sub"] == record.key_id
        # The peer it names accepts it; another region that trusts yul's keys refuses it.
        assert regions[region].authenticate(sent, scope=SCOPE_INFERENCE).key_id == record.key_id
        other = regions["yvr-01" if region == "yyz-01" else "yyz-01"]
        with pytest.raises(APIError) as refused:
            other.authenticate(sent, scope=SCOPE_INFERENCE)
        assert (refused.value.status, refused.value.code) == (401, "invalid_token")
        with pytest.raises(APIError):  # nor does the region that minted it
            yul.authenticate(sent, scope=SCOPE_INFERENCE)


@pytest.mark.parametrize("peer_status, billed_here", [(200, False), (400, False), (503, True)])
def test_a_failed_over_request_is_billed_by_the_region_that_answered_it(tmp_path, router_app, peer_status, billed_here):
    regions = federated_regions(tmp_path, "yul-02", "yvr-01")
    yul = regions["yul-02"]
    key, _ = yul.keys.create_key(owner="alice", tier="standard")
    peers = [Peer(region="yvr-01", endpoint="https://yvr.test")]
    _, app = _fail_over(router_app, yul, f"Bearer {key}", peers, lambda r: httpx.Response(peer_status, json={}))
    # A peer that answered (whatever it said) records the request; none did: this region does.
    assert len(app.recorded()) == (1 if billed_here else 0)


def test_the_hop_header_from_a_client_is_ignored_its_request_fails_over_and_its_record_names_no_origin(
        tmp_path, router_app, monkeypatch):
    """Only a peer's router (its failover token, for this region alone) says a request was
    forwarded: from a client the header would write any origin on its bill and keep its request
    from failing over (the one-hop rule)."""
    regions = federated_regions(tmp_path, "yul-02", "yvr-01")
    yul = regions["yul-02"]
    key, _ = yul.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    forged = {"Authorization": f"Bearer {key}", HOP_HEADER: "fra-01; not a failover at all"}
    served_here = router_app(auth=yul, region=yul.region)
    request_metrics, made = fake_metrics()
    monkeypatch.setattr(telemetry_metrics, "_metrics", request_metrics)
    assert served_here.client.post("/v1/chat/completions", json=body, headers=forged).status_code == 200
    assert [r["failover_origin"] for r in served_here.recorded()] == [None]
    # nor in the metrics: a client's request, counted as this region's client's (hop="client")
    stranger = {HOP_HEADER: "fra-01"}  # not even authenticated
    assert served_here.client.post("/v1/chat/completions", json=body, headers=stranger).status_code == 401
    assert [tags["hop"] for _, tags in made[telemetry_metrics.REQUESTS].points] == ["client", "client"]
    seen = []
    away = router_app(auth=yul, region=yul.region, peers=(Peer(region="yvr-01", endpoint="https://yvr.test"),),
                      transport=httpx.MockTransport(lambda r: seen.append(r) or httpx.Response(200, json={})))
    away.serve.stop(MODEL)
    away.run(away.services.states.refresh)
    assert away.client.post("/v1/chat/completions", json=body, headers=forged).status_code == 200
    assert [r.headers[HOP_HEADER] for r in seen] == ["yul-02"]  # failed over, with its own hop header


def test_a_forwarding_token_never_outlives_the_callers_own_token(tmp_path):
    regions = federated_regions(tmp_path, "yul-02", "yvr-01")
    yul = regions["yul-02"]
    now = int(time.time())
    short = sign(yul.keyset.current().signing_key(), claims(yul, iat=now - 100, nbf=now - 100, exp=now + 5))
    caller = yul.authenticate(f"Bearer {short}", scope=SCOPE_INFERENCE)
    payload = _claims_of(yul.forwarding_token(caller, "yvr-01"))
    assert payload["exp"] <= now + 5


# --- 6. the token endpoint is rate limited per key ----------------------------------------------
def test_the_token_endpoint_is_rate_limited_per_key_before_anything_is_signed(tmp_path, monkeypatch):
    auth = authenticator(tmp_path, token_requests_per_minute=2)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="alice", tier="tiny")  # 2 inference requests/min
    other, _ = auth.keys.create_key(owner="bob", tier="standard")
    assert [client.post("/v1/auth/token", json={"api_key": key}).status_code for _ in range(2)] == [200, 200]
    signed = []
    real_mint = tokens.mint
    monkeypatch.setattr(tokens, "mint", lambda *a, **kw: signed.append(1) or real_mint(*a, **kw))
    refused = client.post("/v1/auth/token", json={"api_key": key})
    assert _error(refused) == (429, "rate_limit_exceeded", None)
    assert int(refused.headers["Retry-After"]) >= 1 and refused.headers["x-ratelimit-limit-requests"] == "2"
    assert "x-ratelimit-limit-tokens" not in refused.headers
    assert signed == []  # refused before any signature
    assert client.post("/v1/auth/token", headers=bearer(key)).status_code == 429  # the header way too
    assert client.post("/v1/auth/token", json={"api_key": other}).status_code == 200  # per key
    # Minting spent none of the key's inference budget.
    assert [chat(client, key).status_code for _ in range(2)] == [200, 200]


def test_the_token_endpoint_budget_is_configurable_and_bounded():
    assert AuthArgs().token_requests_per_minute == 60
    with pytest.raises(ValueError):
        AuthArgs(token_requests_per_minute=0)


# --- 7. a slow limiter fails closed for keys over budget, open only within a bounded grace -------
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Flaky(LocalRateLimiter):
    """The region's actor as the router sees it; ``down`` makes it answer None (timed out)."""

    def __init__(self, limiter: RateLimiter):
        super().__init__(limiter)
        self.down = False
        self.calls = 0

    async def lease(self, *args):
        self.calls += 1
        return None if self.down else await super().lease(*args)


def _run(limiter: LeasedRateLimiter, key: str, n: int, rpm: int, tpm: int = 1_000_000, tokens: int = 10):
    async def go():
        return [(await limiter.acquire(key, rpm, tpm, tokens)) for _ in range(n)]

    return asyncio.run(go())


def test_during_a_limiter_outage_a_key_over_budget_stays_refused():
    clock = Clock()
    source = Flaky(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    assert [d.allowed for d in _run(limiter, "spent", 4, rpm=3)] == [True, True, True, False]
    source.down = True
    clock.now += 1  # well before the bucket refills (20 s a request at 3/min)
    refused = _run(limiter, "spent", 3, rpm=3)
    assert not any(d.allowed for d in refused)
    assert refused[0].retry_after_s > 1 and refused[0].requests.remaining == 0
    clock.now += 20  # its own refill time: one request again, as the actor would allow
    assert [d.allowed for d in _run(limiter, "spent", 2, rpm=3)] == [True, False]


def test_during_a_limiter_outage_a_key_gets_its_last_known_budget_not_everything():
    clock = Clock()
    source = Flaky(RateLimiter(clock))
    limiter = LeasedRateLimiter(source, clock)
    assert all(d.allowed for d in _run(limiter, "known", 5, rpm=10))  # 10/min: no lease slice
    source.down = True
    decisions = _run(limiter, "known", 10, rpm=10)
    assert [d.allowed for d in decisions].count(True) == 5  # what the actor said was left
    # A key this replica never saw gets one lease's slice (at least one request), not a bucket.
    unseen = _run(limiter, "unseen", 100, rpm=600)
    assert sum(d.allowed for d in unseen) == int(600 * lease_module.LEASE_FRACTION)


def test_during_a_limiter_outage_requests_do_not_each_wait_for_the_actor():
    clock = Clock()
    source = Flaky(RateLimiter(clock))
    source.down = True
    limiter = LeasedRateLimiter(source, clock)
    _run(limiter, "k", 5, rpm=600)
    assert source.calls == 1  # then decided alone until OUTAGE_RETRY_S has passed
    clock.now += lease_module.OUTAGE_RETRY_S
    source.down = False
    assert _run(limiter, "k", 1, rpm=600)[0].allowed
    assert source.calls == 2  # the actor is back and decides again


def test_a_limiter_that_cannot_decide_fails_closed_at_the_authenticator(tmp_path):
    class Broken(SharedRateLimiter):
        def actor(self):
            raise ConnectionError("no ray here")

    auth = Authenticator(auth_args(tmp_path), "local", Broken("local"), environ={})
    key, _ = auth.keys.create_key(owner="x", tier="tiny")
    refused = chat(router_client(auth), key)
    assert _error(refused)[:2] == (503, "rate_limiter_unavailable") and refused.headers["Retry-After"] == "1"
    # The router's limiter (leased) keeps deciding from what it knows: this unseen key's first request.
    leased = Authenticator(auth_args(tmp_path), "local", LeasedRateLimiter(Broken("local")), environ={})
    client = router_client(leased)
    assert chat(client, key).status_code == 200
    assert chat(client, key).status_code == 429  # and no more than the grace: fail closed


# --- 8. two Authorization headers are a 400 ------------------------------------------------------
def test_duplicate_authorization_headers_are_400_at_the_router(tmp_path):
    auth = authenticator(tmp_path)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    client = router_client(auth)
    assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    for second in (key, "pgk_ffffffffffff_" + "A" * 43, ""):
        response = client.get("/v1/models", headers=[("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {second}")])
        assert _error(response) == (400, "duplicate_authorization", "authorization")
        assert key not in response.text


def test_duplicate_authorization_headers_are_400_at_the_token_endpoint(tmp_path):
    auth = authenticator(tmp_path)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    client = router_client(auth)
    assert client.post("/v1/auth/token", headers=bearer(key)).status_code == 200
    twice = [("Authorization", f"Bearer {key}"), ("Authorization", "Bearer pgk_ffffffffffff_" + "A" * 43)]
    assert _error(client.post("/v1/auth/token", headers=twice)) == (400, "duplicate_authorization", "authorization")


def test_a_key_in_the_body_and_another_in_the_header_are_400_at_the_token_endpoint(tmp_path):
    """The body's key won silently over the header's: a proxy that checks one and a router that
    uses the other would disagree on who is calling."""
    auth = authenticator(tmp_path)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    other, _ = auth.keys.create_key(owner="mallory", tier="standard")
    client = router_client(auth)
    both = client.post("/v1/auth/token", headers=bearer(other), json={"api_key": key})
    assert _error(both) == (400, "duplicate_authorization", "api_key") and key not in both.text
    assert client.post("/v1/auth/token", json={"api_key": key}).status_code == 200  # either one alone
    assert client.post("/v1/auth/token", headers=bearer(key), json={}).status_code == 200


def test_revoking_another_owners_key_id_leaves_its_cached_row_alone(tmp_path):
    """An owner admin's revoke of an id it does not own dropped that key's cached row on the
    router (a registry read on its owner's next request); ten thousand ids a minute would also
    have thrown away every lookup under way on that router."""
    auth = authenticator(tmp_path, cache_ttl_s=60)
    acme_admin, _ = auth.keys.create_key(owner="acme", tier="standard", models=(MODEL,),
                                         scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
    globex, record = auth.keys.create_key(owner="globex", tier="standard")
    auth.authenticate(f"Bearer {globex}", scope=SCOPE_INFERENCE)  # its row, cached
    caller = auth.authenticate(f"Bearer {acme_admin}", scope=SCOPE_ADMIN)
    assert auth.revoke_key(caller, record.key_id) is False
    assert auth.authenticate(f"Bearer {globex}", scope=SCOPE_INFERENCE, offline=True).owner == "globex"  # no read


def test_the_token_endpoint_refuses_a_body_bigger_than_a_key_before_reading_it(tmp_path):
    """The body is read before any credential is known: a megabyte of JSON objects would be
    parsed for anyone who can reach the router."""
    auth = authenticator(tmp_path)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    client = router_client(auth)
    assert client.post("/v1/auth/token", json={"api_key": key}).status_code == 200
    padded = json.dumps({"api_key": key, "padding": [{}] * 5000})
    response = client.post("/v1/auth/token", content=padded, headers={"content-type": "application/json"})
    assert _error(response)[:2] == (413, "request_too_large")



def test_a_router_reads_the_revocations_from_the_primary_every_cache_ttl_and_a_failure_is_logged(tmp_path, caplog):
    """``KeyStore.follow_revocations`` is what bounds a revocation's reach when the region's
    replica lags (tests/unit/test_key_registry.py); here, that the router runs it and that a
    primary away is logged once, not raised into the loop that runs it."""
    import asyncio

    auth = authenticator(tmp_path, cache_ttl_s=1)
    readings: list[int] = []

    def unreachable():
        raise RuntimeError("primary away")

    async def go():
        auth.keys.follow_revocations = lambda: readings.append(1) or 0
        auth.start()  # no read replica: every lookup reads the primary, nothing to follow
        assert [task.get_name() for task in auth._following] == ["known-key-ids"]
        await auth.aclose()
        auth.keys.database.replica = "postgresql://replica.invalid/registry"  # as a region's
        auth.start()
        async with asyncio.timeout(30):
            while len(readings) < 2:  # every cache_ttl_s (1 s here)
                await asyncio.sleep(0.05)
        auth.keys.follow_revocations = unreachable
        await auth.read_revocations()
        await auth.read_revocations()
        await auth.aclose()
        assert auth._following == []

    asyncio.run(go())
    assert caplog.text.count("reading the revocations from the primary failed") == 1


def test_the_token_endpoints_publish_the_errors_they_answer():
    """Both answer 413 (a body past its bound), 429 (their own rate) and 503 (the registry away),
    which the schema did not list."""
    schema = openapi.build(ingress.app)
    for path in ("/v1/auth/token", "/v1/auth/token/revoke"):
        assert {"413", "429", "503"} <= set(schema["paths"][path]["post"]["responses"]), path
    assert schema["paths"]["/v1/auth/token/revoke"]["post"]["requestBody"]["required"] is True
