"""Auth end to end: the official openai SDK → Serve proxy → two Router replicas → vLLM.

Keys are made with the real ``serve-app`` CLI against the store the routers read (the session
fixture points the config at a tmp dir); nothing is restarted between a CLI edit and its effect.
"""

import subprocess
import sys
import time
from pathlib import Path

import httpx
import jwt
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
OTHER_MODEL = "qwen-3.5-27b"
MESSAGES = [{"role": "user", "content": "Say hi."}]
CACHE_WAIT_S = 20  # > auth.cache_ttl_s (5 s in configs/local.yaml), with room for a slow host


def _cli(serve_app, *argv: str) -> str:
    serve_app_cli = str(Path(sys.executable).with_name("serve-app"))
    done = subprocess.run(
        [serve_app_cli, "--config", str(serve_app["config_path"]), *argv], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _sdk(base_url: str, credential: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=credential, max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, model: str = MODEL):
    return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)


def _mint(base_url: str, key: str) -> str:
    response = httpx.post(f"{base_url}/v1/auth/token", json={"api_key": key}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["access_token"]


def _eventually_refused(base_url: str, credential: str) -> httpx.Response:
    deadline = time.monotonic() + CACHE_WAIT_S
    while True:
        response = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {credential}"})
        if response.status_code != 200 or time.monotonic() > deadline:
            return response
        time.sleep(0.5)


@pytest.fixture(scope="module")
def api_key(serve_app) -> str:
    return _cli(serve_app, "keys", "create", "--owner", "it-alice")


def test_a_raw_api_key_works_as_the_sdks_api_key(base_url, api_key):
    reply = _chat(_sdk(base_url, api_key))
    assert reply.model == MODEL and reply.choices


def test_a_minted_jwt_works_through_the_sdk_streaming_and_not(base_url, api_key, serve_app):
    for token in (_mint(base_url, api_key), _cli(serve_app, "token", "mint", api_key.split("_")[1])):
        client = _sdk(base_url, token)
        assert _chat(client).choices
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=True))
        assert chunks


def test_the_jwks_is_public_and_verifies_the_routers_tokens(base_url, api_key, serve_app):
    token = _mint(base_url, api_key)
    jwks = httpx.get(f"{base_url}/.well-known/jwks.json").json()  # no credential needed
    kid = jwt.get_unverified_header(token)["kid"]
    (jwk,) = [k for k in jwks["keys"] if k["kid"] == kid]
    assert "d" not in jwk
    auth = serve_app["auth"]
    payload = jwt.decode(
        token, jwt.PyJWK(jwk).key, algorithms=["EdDSA"], audience=auth.audience, issuer=auth.issuer
    )
    assert payload["sub"] == api_key.split("_")[1]


@pytest.mark.parametrize(
    "credential", ["pgk_ffffffffffff_" + "A" * 43, "sk-not-a-key", "aaa.bbb.ccc", "unused-locally"]
)
def test_an_invalid_credential_is_an_authentication_error(base_url, credential):
    with pytest.raises(openai.AuthenticationError) as err:
        _chat(_sdk(base_url, credential))
    assert err.value.body["type"] == "authentication_error"
    assert err.value.response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/admin/keys"),
        ("POST", "/v1/admin/keys/0123456789ab/revoke"),
        ("POST", "/v1/auth/token"),
    ],
)
def test_every_api_endpoint_needs_a_credential(base_url, method, path):
    response = httpx.request(method, f"{base_url}{path}", json={"model": MODEL} if method == "POST" else None)
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.headers["www-authenticate"] == 'Bearer realm="serve_app"'


def test_health_and_jwks_need_none(base_url):
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{base_url}/.well-known/jwks.json").status_code == 200


def test_the_public_schema_lists_no_admin_route(base_url):
    paths = set(httpx.get(f"{base_url}/openapi.json", timeout=30).json()["paths"])  # no credential
    assert "/v1/chat/completions" in paths and "/v1/auth/token" in paths
    assert not [p for p in paths if p.startswith("/v1/admin/") or p in ("/v1/models/load", "/v1/models/unload")]


def test_two_authorization_headers_are_a_400(base_url, api_key):
    twice = [("Authorization", f"Bearer {api_key}"), ("Authorization", "Bearer pgk_ffffffffffff_" + "A" * 43)]
    response = httpx.get(f"{base_url}/v1/models", headers=twice)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "duplicate_authorization"


def test_a_key_with_a_trailing_newline_is_not_exchanged(base_url, api_key):
    response = httpx.post(f"{base_url}/v1/auth/token", json={"api_key": api_key + "\n"}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_a_model_outside_the_keys_scope_is_permission_denied(base_url, serve_app):
    key = _cli(serve_app, "keys", "create", "--owner", "it-bob", "--model", OTHER_MODEL)
    client = _sdk(base_url, key)
    with pytest.raises(openai.PermissionDeniedError) as err:
        _chat(client)
    assert err.value.body["code"] == "model_not_allowed"
    assert client.models.list().data == []  # it only sees what it may use
    with pytest.raises(openai.PermissionDeniedError):
        _chat(_sdk(base_url, _mint(base_url, key)))


def test_a_region_outside_the_keys_scope_is_permission_denied(base_url, serve_app):
    key = _cli(serve_app, "keys", "create", "--owner", "it-carol", "--region", "yul-02")
    with pytest.raises(openai.PermissionDeniedError) as err:
        _chat(_sdk(base_url, key))
    assert err.value.body["code"] == "region_not_allowed"


def test_admin_endpoints_need_the_admin_scope(base_url, api_key, dev_key, serve_app):
    headers = {"Authorization": f"Bearer {api_key}"}
    assert httpx.get(f"{base_url}/v1/admin/keys", headers=headers).status_code == 403
    admin = {"Authorization": f"Bearer {dev_key}"}
    listed = httpx.get(f"{base_url}/v1/admin/keys", headers=admin)
    assert listed.status_code == 200
    assert "it-alice" in {k["owner"] for k in listed.json()["data"]}

    victim = _cli(serve_app, "keys", "create", "--owner", "it-dave")
    assert _chat(_sdk(base_url, victim)).choices
    revoke = httpx.post(f"{base_url}/v1/admin/keys/{victim.split('_')[1]}/revoke", headers=admin)
    assert revoke.status_code == 200
    refused = _eventually_refused(base_url, victim)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "api_key_revoked"


def test_a_revoked_token_is_refused_without_a_restart(base_url, api_key, serve_app):
    token = _mint(base_url, api_key)
    assert _chat(_sdk(base_url, token)).choices
    _cli(serve_app, "token", "revoke", token)
    refused = _eventually_refused(base_url, token)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "token_revoked"


def test_signing_key_rotation_keeps_live_tokens_valid(base_url, api_key, serve_app):
    before = _mint(base_url, api_key)
    _cli(serve_app, "signing", "rotate")
    assert _chat(_sdk(base_url, before)).choices
    deadline = time.monotonic() + CACHE_WAIT_S
    after = _mint(base_url, api_key)
    while jwt.get_unverified_header(after)["kid"] == jwt.get_unverified_header(before)["kid"]:
        assert time.monotonic() < deadline, "routers never picked up the rotated keyset"
        time.sleep(0.5)
        after = _mint(base_url, api_key)
    assert _chat(_sdk(base_url, after)).choices
    assert _chat(_sdk(base_url, before)).choices


def test_the_rate_limit_is_one_budget_across_router_replicas(base_url, serve_app):
    import ray
    from ray import serve

    router = serve.status().applications[serve_app["app_name"]].deployments["Router"]
    assert router.replica_states.get("RUNNING") == 2
    key = _cli(serve_app, "keys", "create", "--owner", "it-tiny", "--tier", "tiny")  # 3 requests/min
    client = _sdk(base_url, key)
    admitted, refused = 0, None
    for _ in range(6):  # per-replica buckets would admit up to 6 across two routers
        try:
            _chat(client)
            admitted += 1
        except openai.RateLimitError as err:
            refused = err
    assert admitted == 3
    assert refused is not None and refused.body["code"] == "rate_limit_exceeded"
    headers = refused.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    for name in ("reset-requests", "limit-tokens", "remaining-tokens", "reset-tokens"):
        assert headers[f"x-ratelimit-{name}"]
    limiter = ray.get_actor("ratelimit-local", namespace="serve_app")  # the one region-wide actor
    assert ray.get(limiter.bucket_count.remote()) >= 2


def test_successful_responses_carry_ratelimit_headers(base_url, api_key):
    response = _sdk(base_url, api_key).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2
    )
    assert int(response.headers["x-ratelimit-limit-requests"]) > 0
    assert response.headers["x-ratelimit-remaining-tokens"]


def test_no_key_or_token_reached_any_log(base_url, api_key, dev_key):
    """After every test above (valid, invalid, revoked credentials), grep all of this Ray
    session's logs (router replicas, proxy, controller, workers) for the secrets."""
    import ray

    token = _mint(base_url, api_key)
    httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key[:-2]}xx"})
    secrets_used = [api_key.rsplit("_", 1)[1], token.rsplit(".", 1)[1], dev_key]
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    time.sleep(2)  # let log writers flush
    for path in logs.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            for secret in secrets_used:
                assert secret not in text, f"a credential appears in {path}"
