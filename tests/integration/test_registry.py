"""Two regions, one key registry on a real PostgreSQL server (the session's ``local`` and ``peer``
share it, as regions do): a key created once works in both; a key or token revoked in one is
refused by the other within the registry cache's TTL (``auth.cache_ttl_s``, 5 s)."""

import time

import httpx
import jwt
import pytest

from serve_app.auth.keys import KeyStore

pytestmark = pytest.mark.integration

CACHE_TTL_S = 5  # configs/local.yaml keeps the default


def _models(url: str, credential: str) -> int:
    return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {credential}"}, timeout=30).status_code


def _refused_within(url: str, credential: str, bound_s: float) -> float:
    started = time.monotonic()
    while _models(url, credential) == 200:
        assert time.monotonic() - started < bound_s, f"still accepted after {bound_s} s"
        time.sleep(0.2)
    return time.monotonic() - started


def _refused_everywhere_once_the_bound_has_passed(urls: list[str], credential: str, revoked_at: float) -> None:
    """Past ``cache_ttl_s`` after a revocation every router refuses it — each of a region's router
    replicas, whichever serves (a router that read the row just before the revocation may serve it
    until then; one that uses it steadily reads it again sooner, so one region refusing says nothing
    of another's replicas)."""
    time.sleep(max(0.0, revoked_at + CACHE_TTL_S + 0.5 - time.monotonic()))
    for url in urls:
        assert [_models(url, credential) for _ in range(6)] == [401] * 6, url


def test_the_session_registry_is_postgres(serve_app):
    assert str(serve_app["auth"].key_store()).startswith("postgresql://")


def test_a_key_created_once_works_in_every_region_and_its_revocation_reaches_them(serve_app):
    store = KeyStore(serve_app["auth"].key_store(), cache_ttl_s=0)  # what `serve-app keys create` opens
    key, record = store.create_key(owner="it-registry", tier="standard")
    local, peer = serve_app["base_url"], serve_app["peer_url"]
    assert _models(local, key) == 200 and _models(peer, key) == 200
    revoked = httpx.post(
        f"{local}/v1/admin/keys/{record.key_id}/revoke",
        headers={"Authorization": f"Bearer {serve_app['dev_key']}"}, timeout=30,
    )
    assert revoked.status_code == 200
    revoked_at = time.monotonic()
    _refused_within(peer, key, CACHE_TTL_S + 1)
    _refused_everywhere_once_the_bound_has_passed([peer, local], key, revoked_at)


def test_a_token_revoked_in_one_region_is_refused_in_the_other(serve_app):
    store = KeyStore(serve_app["auth"].key_store(), cache_ttl_s=0)
    key, _ = store.create_key(owner="it-registry-token", tier="standard")
    local, peer = serve_app["base_url"], serve_app["peer_url"]
    token = httpx.post(f"{local}/v1/auth/token", json={"api_key": key}, timeout=30).json()["access_token"]
    assert _models(peer, token) == 200
    claims = jwt.decode(token, options={"verify_signature": False})
    store.revoke_jti(claims["jti"], purge_after=claims["exp"])  # `serve-app tokens revoke`
    revoked_at = time.monotonic()
    _refused_within(peer, token, CACHE_TTL_S + 1)
    _refused_everywhere_once_the_bound_has_passed([peer, local], token, revoked_at)
