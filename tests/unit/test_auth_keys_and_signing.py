"""Key storage (hashes only, constant-time comparison, jti revocation), signing-key rotation, JWKS
and cross-region verification, with real Ed25519 keys and a real SQLite store."""

import hashlib
import time

import pytest

from serve_app.auth import keys as keys_module
from serve_app.auth import tokens
from serve_app.auth.keys import KeyStore, parse_key
from serve_app.auth.principal import Principal
from tests.unit.auth_support import DEV_KEY, authenticator, chat
from router_app import router_client


def test_keys_are_recognisable_and_only_their_hash_is_stored(tmp_path):
    store = KeyStore(tmp_path / "keys.sqlite3", create=True)
    key, record = store.create_key(owner="alice", tier="standard")
    key_id, secret = parse_key(key)
    assert key.startswith("pgk_") and key_id == record.key_id
    assert len(secret) == 43  # ~256 bits of base62
    assert record.secret_sha256 == hashlib.sha256(secret.encode()).digest()
    raw = (tmp_path / "keys.sqlite3").read_bytes()
    assert secret.encode() not in raw and key.encode() not in raw
    assert "secret" not in repr(store.list_keys()[0]).replace("secret_sha256", "")
    assert (tmp_path / "keys.sqlite3").stat().st_mode & 0o077 == 0


def test_secrets_are_compared_in_constant_time(tmp_path, monkeypatch):
    store = KeyStore(tmp_path / "keys.sqlite3", create=True)
    key, _ = store.create_key(owner="alice", tier="standard")
    calls = []
    real = keys_module.hmac.compare_digest
    monkeypatch.setattr(keys_module.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    assert store.lookup(key) is not None
    assert store.lookup(key[:-1] + ("a" if key[-1] != "a" else "b")) is None
    assert len(calls) == 2 and all(len(a) == len(b) == 32 for a, b in calls)


@pytest.mark.parametrize("raw", ["", "pgk_", "pgk_0123456789ab_short", "sk-123", "pgk_XYZ_" + "a" * 43])
def test_malformed_keys_do_not_parse(raw):
    assert parse_key(raw) is None


def test_a_revoked_jti_is_remembered_until_it_could_have_expired(tmp_path):
    store = KeyStore(tmp_path / "keys.sqlite3", create=True, cache_ttl_s=0)
    store.revoke_jti("old", purge_after=int(time.time()) - 1)
    store.revoke_jti("live", purge_after=int(time.time()) + 600)  # also purges "old"
    assert store.is_jti_revoked("live")
    assert not store.is_jti_revoked("old")
    assert not store.is_jti_revoked("never")


def test_a_region_store_is_never_created_by_accident(tmp_path):
    with pytest.raises(FileNotFoundError, match="serve-app keys create"):
        KeyStore(tmp_path / "missing.sqlite3")
    with pytest.raises(FileNotFoundError, match="serve-app signing rotate"):
        tokens.KeysetFile(tmp_path / "missing.json")


def test_rotation_keeps_live_tokens_valid_and_removal_ends_them(tmp_path):
    auth = authenticator(tmp_path)
    client = router_client(auth)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    before = client.post("/v1/auth/token", json={"api_key": key}).json()["access_token"]
    old_kid = tokens.load_keyset(auth.keyset.path).signing_key().kid

    tokens.save_keyset(auth.keyset.path, tokens.load_keyset(auth.keyset.path).rotated())  # `signing rotate`
    after = client.post("/v1/auth/token", json={"api_key": key}).json()["access_token"]
    import jwt

    assert jwt.get_unverified_header(after)["kid"] != old_kid  # the newest key signs
    assert {k["kid"] for k in auth.jwks()["keys"]} >= {old_kid, jwt.get_unverified_header(after)["kid"]}
    assert chat(client, before).status_code == 200  # the old key still verifies
    assert chat(client, after).status_code == 200

    tokens.save_keyset(auth.keyset.path, tokens.load_keyset(auth.keyset.path).without(old_kid))  # `signing remove`
    refused = chat(client, before)
    assert refused.status_code == 401
    assert "unknown key" in refused.json()["error"]["message"]
    assert chat(client, after).status_code == 200


def test_a_router_that_has_not_reloaded_yet_still_accepts_a_new_kid(tmp_path):
    """Another router rotates and signs with the new key at once; this router's periodic check is
    not due for a minute, but the unknown kid forces one reload instead of a 401."""
    auth = authenticator(tmp_path, cache_ttl_s=60)
    key, record = auth.keys.create_key(owner="alice", tier="standard")
    rotated = tokens.load_keyset(auth.keyset.path).rotated()
    tokens.save_keyset(auth.keyset.path, rotated)
    token, _ = tokens.mint(
        rotated,
        issuer=auth.args.issuer,
        audience=auth.args.audience,
        subject=record.key_id,
        ttl_s=60,
        claims=Principal.from_record(record).claims(),
    )
    assert chat(router_client(auth), token).status_code == 200


def test_the_last_signing_key_cannot_be_removed(tmp_path):
    keyset = tokens.Keyset((tokens.SigningKey.generate(),))
    with pytest.raises(ValueError, match="no private key"):
        keyset.without(keyset.keys[0].kid)


def test_a_token_minted_in_one_region_verifies_in_another_that_imported_its_jwks(tmp_path):
    registry = str(tmp_path / "registry.sqlite3")  # regions share one key registry
    yul = authenticator(tmp_path / "yul", region="yul-02", dev_api_key_env=None, key_store_path=registry)
    yvr = authenticator(tmp_path / "yvr", region="yvr-01", dev_api_key_env=None, key_store_path=registry)
    key, _ = yul.keys.create_key(owner="alice", tier="standard")
    token = router_client(yul).post("/v1/auth/token", json={"api_key": key}).json()["access_token"]
    yvr_client = router_client(yvr)
    assert chat(yvr_client, token).status_code == 401  # not trusted yet
    yvr_path = yvr.keyset.path
    tokens.save_keyset(yvr_path, tokens.load_keyset(yvr_path).with_imported(yul.jwks()))  # `signing import-jwks`
    response = chat(yvr_client, token)
    assert response.status_code == 200, response.text
    assert yvr.authenticate(f"Bearer {token}", scope="inference").key_id == key.split("_")[1]
    # A region with a registry of its own does not know the key: the token is refused there.
    apart = authenticator(tmp_path / "apart", region="yvr-01", dev_api_key_env=None)
    tokens.save_keyset(apart.keyset.path, tokens.load_keyset(apart.keyset.path).with_imported(yul.jwks()))
    apart.keyset = tokens.KeysetFile(apart.keyset.path, check_interval_s=0)
    refused = chat(router_client(apart), token)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_token"
    assert "not in the key registry" in refused.json()["error"]["message"]
    imported = [k for k in tokens.load_keyset(yvr_path).keys if k.private_pem is None]
    assert imported and all(k.public_jwk.keys() == {"kty", "crv", "x"} for k in imported)


def test_two_routers_creating_the_local_keyset_at_once_agree(tmp_path):
    path = tmp_path / "signing-keys.json"
    first = tokens.create_keyset(path)
    second = tokens.create_keyset(path)  # lost the race: reads the winner's file
    assert first.signing_key().kid == second.signing_key().kid
    assert path.stat().st_mode & 0o077 == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_dev_key_tokens_and_keys_do_not_authenticate_in_a_region(tmp_path):
    yul = authenticator(tmp_path, region="yul-02", dev_api_key_env=None)
    assert chat(router_client(yul), DEV_KEY).status_code == 401


def test_the_event_loop_never_waits_on_the_key_store(tmp_path, monkeypatch):
    """authenticate_async answers from the cache in the loop; a miss goes to a worker thread
    (a key this router has not seen yet: one of the threads kept for unknown ids)."""
    import asyncio
    import threading

    from serve_app.auth.keys import SCOPE_INFERENCE
    from tests.unit.auth_support import authenticator

    auth = authenticator(tmp_path, cache_ttl_s=5)
    key, _ = auth.keys.create_key(owner="alice", tier="standard")
    queried_on = []
    real_connect = auth.keys.database.connect

    def recording_connect(read: bool = False):
        queried_on.append(threading.current_thread())
        return real_connect(read)

    monkeypatch.setattr(auth.keys.database, "connect", recording_connect)

    async def twice():
        first = await auth.authenticate_async(f"Bearer {key}", scope=SCOPE_INFERENCE)
        second = await auth.authenticate_async(f"Bearer {key}", scope=SCOPE_INFERENCE)
        return first, second

    first, second = asyncio.run(twice())
    assert first.key_id == second.key_id and first.via == "api_key"
    assert len(queried_on) == 1  # the first (cache miss) only
    assert queried_on[0] is not threading.main_thread()  # not the event loop's thread
