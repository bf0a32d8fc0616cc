"""Every credential the router must refuse is a 401 with an OpenAI-style body and a
``WWW-Authenticate`` challenge; scope, model and region violations are 403. Real Ed25519 keys,
real pyjwt, a real SQLite store; no Ray."""

import logging
import time

import pytest

from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, KeyStore
from serve_app.auth.tokens import SigningKey
from tests.unit.fake_processes import Clock
from tests.unit.auth_support import (
    DEV_KEY,
    MODEL,
    OTHER_MODEL,
    authenticator,
    bearer,
    chat,
    claims,
    current_key,
    hs256_with_public_key,
    sign,
    tamper_signature,
    unsigned,
)
from router_app import router_client


@pytest.fixture
def auth(tmp_path):
    return authenticator(tmp_path)


@pytest.fixture
def client(auth):
    return router_client(auth)


@pytest.fixture
def api_key(auth):
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    return key


def _token(client, api_key: str) -> str:
    response = client.post("/v1/auth/token", json={"api_key": api_key})
    assert response.status_code == 200, response.text
    return response.json()["access_token"]


def _bad_credentials(auth, client, api_key) -> dict[str, dict[str, str]]:
    """Name → request headers, one per attack or mistake the issue lists (and a few more)."""
    key = current_key(auth)
    now = int(time.time())
    revoked_key, revoked_record = auth.keys.create_key(owner="eve", tier="standard")
    token_of_revoked_key = _token(client, revoked_key)
    auth.keys.revoke_key(revoked_record.key_id)
    revoked_jti_token = _token(client, api_key)
    auth.keys.revoke_jti(claims_of(revoked_jti_token)["jti"], purge_after=now + 3600)
    stranger = SigningKey.generate()
    return {
        "alg none": bearer(unsigned({"alg": "none", "typ": "JWT", "kid": key.kid}, claims(auth))),
        "alg None, no kid": bearer(unsigned({"alg": "None"}, claims(auth))),
        "HS256 keyed with the public key": bearer(hs256_with_public_key(key, claims(auth))),
        "expired": bearer(sign(key, claims(auth, iat=now - 7200, nbf=now - 7200, exp=now - 3600))),
        "not yet valid": bearer(sign(key, claims(auth, nbf=now + 3600, exp=now + 7200))),
        "issued in the future": bearer(sign(key, claims(auth, iat=now + 3600, exp=now + 7200))),
        "wrong aud": bearer(sign(key, claims(auth, aud="https://someone-else"))),
        "wrong iss": bearer(sign(key, claims(auth, iss="https://evil"))),
        "missing jti": bearer(sign(key, claims(auth, jti=None))),
        "missing exp": bearer(sign(key, claims(auth, exp=None))),
        "tampered signature": bearer(tamper_signature(_token(client, api_key))),
        "tampered payload": bearer(_swap_payload(_token(client, api_key), claims(auth, models=["*"]))),
        "unknown kid": bearer(sign(stranger, claims(auth), kid="not-a-kid-we-have")),
        "kid path injection": bearer(sign(stranger, claims(auth), kid="../../signing-keys.json")),
        "right kid, wrong key": bearer(sign(stranger, claims(auth), kid=key.kid)),
        "malformed claims": bearer(sign(key, claims(auth, models="*"))),
        # A well-signed token must name a key: "" once read as every key's usage (GET /v1/usage).
        "empty subject": bearer(sign(key, claims(auth, sub=""))),
        "subject not a key id": bearer(sign(key, claims(auth, sub="ffffffffffff' OR 1=1"))),
        "garbage token": bearer("aaa.bbb.ccc"),
        "revoked key (raw)": bearer(revoked_key),
        "revoked key (token)": bearer(token_of_revoked_key),
        "revoked jti": bearer(revoked_jti_token),
        "wrong secret": bearer(api_key[:-4] + "AAAA"),
        "unknown key id": bearer("pgk_ffffffffffff_" + "A" * 43),
        "not a key at all": bearer("sk-proj-1234"),
        "malformed header: Basic": {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
        "malformed header: no credential": {"Authorization": "Bearer"},
        "malformed header: two credentials": {"Authorization": f"Bearer {api_key} extra"},
        "malformed header: no scheme": {"Authorization": api_key},
        "empty header": {"Authorization": ""},
        "missing header": {},
    }


def claims_of(token: str) -> dict:
    import jwt

    return jwt.decode(token, options={"verify_signature": False})


def _swap_payload(token: str, payload: dict) -> str:
    head, _, sig = token.split(".")
    _, body, _ = unsigned({}, payload).split(".")
    return f"{head}.{body}.{sig}"


def test_every_bad_credential_is_401_with_an_openai_body_and_a_challenge(auth, client, api_key):
    for name, headers in _bad_credentials(auth, client, api_key).items():
        response = client.post("/v1/chat/completions", json={"model": MODEL}, headers=headers)
        assert response.status_code == 401, f"{name}: {response.status_code} {response.text}"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["type"] == "authentication_error", name
        assert error["code"], name
        challenge = response.headers["WWW-Authenticate"]
        assert challenge.startswith('Bearer realm="serve_app"'), name
        if name in ("missing header", "empty header"):
            assert "error=" not in challenge  # RFC 6750: no error code without a credential
        else:
            assert 'error="invalid_' in challenge, name


def test_expired_and_revoked_say_so(auth, client, api_key):
    bad = _bad_credentials(auth, client, api_key)
    codes = {
        name: client.post("/v1/chat/completions", json={"model": MODEL}, headers=bad[name]).json()["error"]["code"]
        for name in ("expired", "not yet valid", "revoked jti", "revoked key (raw)", "revoked key (token)", "missing header")
    }
    assert codes == {
        "expired": "token_expired",
        "not yet valid": "token_not_yet_valid",
        "revoked jti": "token_revoked",
        "revoked key (raw)": "api_key_revoked",
        "revoked key (token)": "api_key_revoked",
        "missing header": "missing_authorization",
    }


def test_credentials_never_reach_the_logs_or_the_response(auth, client, api_key, caplog):
    caplog.set_level(logging.DEBUG)
    bad = _bad_credentials(auth, client, api_key)
    bodies = []
    for headers in bad.values():
        response = client.post("/v1/chat/completions", json={"model": MODEL}, headers=headers)
        bodies.append(response.text + str(response.headers))
    secrets_sent = [h["Authorization"].split()[-1] for h in bad.values() if h.get("Authorization", "").strip()]
    secrets_sent += [api_key, api_key.rsplit("_", 1)[1]]
    assert "auth refused" in caplog.text  # refusals are logged, by code
    for secret in secrets_sent:
        if len(secret) < 12:
            continue  # "Bearer" and the like
        assert secret not in caplog.text
        assert all(secret not in body for body in bodies)


def test_a_raw_key_a_token_and_the_dev_key_all_work(auth, client, api_key):
    for credential, via in ((api_key, "api_key"), (_token(client, api_key), "token"), (DEV_KEY, "dev_key")):
        response = chat(client, credential)
        assert response.status_code == 200, response.text
        assert auth.authenticate(f"Bearer {credential}", scope=SCOPE_INFERENCE).via == via
        assert response.headers["x-ratelimit-limit-requests"]


def test_the_scheme_is_case_insensitive(client, api_key):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"bearer {api_key}"})
    assert response.status_code == 200


def test_a_model_outside_the_scope_is_403(auth, client):
    key, _ = auth.keys.create_key(owner="bob", tier="standard", models=(OTHER_MODEL,))
    for credential in (key, _token(client, key)):
        response = chat(client, credential, model=MODEL)
        assert response.status_code == 403
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("permission_error", "model_not_allowed")
        assert chat(client, credential, model=OTHER_MODEL).status_code == 200


def test_a_region_outside_the_scope_is_403(auth, client):
    key, _ = auth.keys.create_key(owner="bob", tier="standard", regions=("yul-02",))
    token = _token(client, key)  # minting is allowed anywhere: the token is for yul-02
    for credential in (key, token):
        response = chat(client, credential)
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "region_not_allowed"


def test_admin_endpoints_need_the_admin_scope(auth, client, api_key):
    admin_key, _ = auth.keys.create_key(owner="ops", tier="standard",
                                        scopes=(SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR))
    refused = client.get("/v1/admin/keys", headers=bearer(api_key))
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "insufficient_scope"
    assert 'error="insufficient_scope", scope="admin"' in refused.headers["WWW-Authenticate"]
    for credential in (admin_key, _token(client, admin_key), DEV_KEY):
        listed = client.get("/v1/admin/keys", headers=bearer(credential))
        assert listed.status_code == 200
        assert "secret_sha256" not in listed.text
        assert {k["owner"] for k in listed.json()["data"]} == {"alice", "ops"}


def test_an_admin_only_key_cannot_run_inference(auth, client):
    key, _ = auth.keys.create_key(owner="ops", tier="standard", scopes=(SCOPE_ADMIN,))
    assert chat(client, key).status_code == 403


def test_a_token_carries_the_registered_claims_and_the_keys_scope(auth, client):
    key, record = auth.keys.create_key(owner="carol", tier="standard", models=(MODEL,), expires_at=int(time.time()) + 120)
    answer = client.post("/v1/auth/token", headers=bearer(key)).json()  # key as Bearer, no body
    assert answer["token_type"] == "Bearer"
    import jwt

    header = jwt.get_unverified_header(answer["access_token"])
    assert header["alg"] == "EdDSA" and header["kid"] == current_key(auth).kid
    payload = claims_of(answer["access_token"])
    assert {"iss", "aud", "sub", "exp", "iat", "nbf", "jti"} <= set(payload)
    assert payload["sub"] == record.key_id
    assert payload["models"] == [MODEL]
    assert payload["scope"] == "inference"
    assert payload["exp"] <= record.expires_at  # never outlives its key
    assert answer["expires_in"] <= 120


def test_the_token_endpoint_takes_keys_not_tokens(client, api_key):
    token = _token(client, api_key)
    response = client.post("/v1/auth/token", json={"api_key": token})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "api_key_required"
    assert client.post("/v1/auth/token", json={"api_key": "pgk_nope"}).status_code == 401
    assert client.post("/v1/auth/token").status_code == 401


def test_an_expired_key_is_refused(auth, client):
    key, _ = auth.keys.create_key(owner="old", tier="standard", expires_at=int(time.time()) - 1)
    response = chat(client, key)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "api_key_expired"
    assert client.post("/v1/auth/token", json={"api_key": key}).status_code == 401


def test_jwks_publishes_public_keys_only(auth):
    jwks = auth.jwks()
    (jwk,) = jwks["keys"]
    assert set(jwk) == {"kty", "crv", "x", "kid", "alg", "use", "region"}
    assert jwk["region"] == "local"  # an importing region binds the kid to us
    assert (jwk["kty"], jwk["crv"], jwk["alg"]) == ("OKP", "Ed25519", "EdDSA")


def test_the_dev_key_is_only_a_key_when_its_env_var_is_set(tmp_path):
    from serve_app.auth.authenticator import Authenticator
    from serve_app.auth.ratelimit import LocalRateLimiter
    from tests.unit.auth_support import auth_args

    without = Authenticator(auth_args(tmp_path), "local", LocalRateLimiter(), environ={})
    assert chat(router_client(without), DEV_KEY).status_code == 401
    empty = Authenticator(auth_args(tmp_path), "local", LocalRateLimiter(), environ={"SERVE_APP_DEV_API_KEY": ""})
    assert chat(router_client(empty), "").status_code == 401


def test_key_store_edits_reach_a_running_authenticator_after_the_cache_ttl(tmp_path):
    auth = authenticator(tmp_path, cache_ttl_s=5)
    clock = Clock()  # the key cache's, moved by the test: a slow host cannot expire a row early
    auth.keys = KeyStore(auth.args.key_store(), cache_ttl_s=5, clock=clock)
    client = router_client(auth)
    cli_store = KeyStore(auth.args.key_store())  # what `serve-app keys ...` opens
    key, record = cli_store.create_key(owner="dave", tier="standard")
    assert chat(client, key).status_code == 200  # a new key works at once (first lookup)
    cli_store.revoke_key(record.key_id)
    clock.now += 2.4
    assert chat(client, key).status_code == 200  # cached for up to cache_ttl_s
    clock.now += 2.7
    assert chat(client, key).status_code == 401
