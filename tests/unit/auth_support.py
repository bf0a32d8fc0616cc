"""Shared set-up for the auth unit tests: a real key store and keyset in a tmp dir, and a token
forger that signs with the real keys (or deliberately wrong ones). No Ray: the limiter is the
in-process one. The router itself is the real one (``router_app.router_client``)."""

import base64
import hashlib
import hmac
import json
import secrets
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from serve_app.auth.authenticator import Authenticator
from serve_app.auth.config import AuthArgs, Tier
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, KeyStore
from serve_app.auth.ratelimit import LocalRateLimiter, RateLimiter
from serve_app.auth.tokens import Keyset, SigningKey, create_keyset
from serve_app.errors import APIError
from serve_app.router.pricing import price

MODEL = "qwen-3.6-35b-a3b"
OTHER_MODEL = "qwen-3.5-27b"
DEV_KEY = "sk-unit-dev-key-0123456789"


TIERS = {
    "standard": Tier(requests_per_minute=600, tokens_per_minute=1_000_000),
    "tiny": Tier(requests_per_minute=2, tokens_per_minute=1_000),
    "dev": Tier(requests_per_minute=100_000, tokens_per_minute=10**9),
}


def auth_args(tmp_path: Path, **overrides: Any) -> AuthArgs:
    values: dict[str, Any] = {
        "key_store_path": str(tmp_path / "keys.sqlite3"),
        "signing_keys_path": str(tmp_path / "signing-keys.json"),
        "issuer": "https://auth.test",
        "audience": "https://api.test",
        "cache_ttl_s": 0,  # tests see store edits at once unless they test the cache
        "tiers": TIERS,
        "dev_api_key_env": "SERVE_APP_DEV_API_KEY",
    }
    return AuthArgs(**(values | overrides))


def authenticator(tmp_path: Path, region: str = "local", limiter: RateLimiter | None = None, **overrides) -> Authenticator:
    args = auth_args(tmp_path, **overrides)
    if region != "local":  # a region is provisioned by the operator (CLI) before it starts
        KeyStore(args.key_store(), create=True)
        create_keyset(args.signing_keys())
    return Authenticator(
        args,
        region,
        LocalRateLimiter(limiter),
        environ={"SERVE_APP_DEV_API_KEY": DEV_KEY},
    )


def federated_regions(tmp_path: Path, *names: str) -> dict[str, Authenticator]:
    """Regions that import each other's JWKS, as `serve-app signing import-jwks` does (from the
    JWKS the router serves, which names each key's region), and read one key registry, as every
    region does (a token whose key the registry does not hold is refused)."""
    from serve_app.auth import tokens

    registry = str(tmp_path / "registry.sqlite3")
    auths = {
        name: authenticator(tmp_path / name, region=name, dev_api_key_env=None, key_store_path=registry)
        for name in names
    }
    for auth in auths.values():
        keyset = tokens.load_keyset(auth.keyset.path)
        for other in auths.values():
            if other is not auth:
                keyset = keyset.with_imported(other.jwks())
        tokens.save_keyset(auth.keyset.path, keyset)
        auth.keyset = tokens.KeysetFile(auth.keyset.path, check_interval_s=0)
    return auths


def api_app() -> FastAPI:
    """An app that answers ``APIError`` as the router does (OpenAI-shaped body, its headers)."""
    app = FastAPI()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    return app


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def chat(client: TestClient, credential: str | None, model: str = MODEL, **body):
    headers = bearer(credential) if credential else {}
    chat_body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    return client.post("/v1/chat/completions", json=chat_body, headers=headers)


# --- forging tokens --------------------------------------------------------------------------
def claims(auth: Authenticator, **overrides: Any) -> dict[str, Any]:
    """A token's claims for ``auth``; its subject, unless given, a key the registry holds
    (mallory's, standard, every model and scope): a token for a key it does not hold is refused."""
    now = int(time.time())
    base = {
        "iss": auth.args.issuer,
        "aud": auth.args.audience,
        "sub": overrides.get("sub") or registered_key_id(auth),
        "iat": now,
        "nbf": now,
        "exp": now + 300,
        "jti": secrets.token_urlsafe(8),
        "owner": "mallory",
        "models": ["*"],
        "regions": ["*"],
        "tier": "standard",
        "scope": "inference admin",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def registered_key_id(auth: Authenticator) -> str:
    """mallory's key in ``auth``'s registry, created on first use."""
    key_id = getattr(auth, "_unit_test_key_id", None)
    if key_id is None:
        _, record = auth.keys.create_key(owner="mallory", tier="standard", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN))
        key_id = auth._unit_test_key_id = record.key_id
    return key_id


def sign(key: SigningKey, payload: dict[str, Any], kid: str | None = None) -> str:
    return jwt.encode(payload, key.private_key, algorithm="EdDSA", headers={"kid": kid or key.kid})


def current_key(auth: Authenticator) -> SigningKey:
    return auth.keyset.current().signing_key()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unsigned(header: dict[str, Any], payload: dict[str, Any], signature: bytes = b"") -> str:
    return f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(payload).encode())}.{_b64(signature)}"


def hs256_with_public_key(key: SigningKey, payload: dict[str, Any]) -> str:
    """The algorithm-confusion attack: HMAC keyed with the (public) verification key's PEM."""
    pem = key.public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    header = {"alg": "HS256", "typ": "JWT", "kid": key.kid}
    signing_input = unsigned(header, payload).rsplit(".", 1)[0]
    return f"{signing_input}.{_b64(hmac.new(pem, signing_input.encode(), hashlib.sha256).digest())}"


def tamper_signature(token: str) -> str:
    head, body, sig = token.split(".")
    middle = len(sig) // 2  # not the last char: its low bits are padding and may not matter
    flipped = "A" if sig[middle] != "A" else "B"
    return f"{head}.{body}.{sig[:middle]}{flipped}{sig[middle + 1:]}"


def fresh_keyset() -> Keyset:
    return Keyset((SigningKey.generate(),))
