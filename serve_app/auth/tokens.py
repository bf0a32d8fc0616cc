"""Access tokens: EdDSA (Ed25519) JWTs, the signing keyset, and its public half as a JWKS.

The keyset is a JSON file holding several keys, each named by a ``kid``. The newest key that has a
private half signs; every key in the file verifies. Rotation appends a key, so tokens signed by the
previous key stay valid until they expire; removing a key ends them. Entries without a private half
are verify-only: keys imported from another region's JWKS, so that region's tokens verify here.
Each kid is bound to the region that issued it: a key with a private half is this region's own; an
imported key belongs to another region (named in ``region`` when its JWKS said so). The
authenticator grants less to tokens signed by imported keys (no admin scope), so one compromised
region cannot mint tokens that administer every region.

Verification is strict: only ``EdDSA`` is accepted (never ``none`` or an HMAC algorithm that could
be keyed with our public key), the ``kid`` must name a key we hold, and ``exp``, ``iat``, ``nbf``,
``iss``, ``aud``, ``sub`` and ``jti`` are all required; a token whose lifetime (``exp - iat``) is
longer than the configured maximum plus the leeway is refused, however good its signature.
"""

import json
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from jwt.algorithms import OKPAlgorithm

from serve_app.auth.config import MAX_TOKEN_TTL_S

ALGORITHM = "EdDSA"
REQUIRED_CLAIMS = ["exp", "iat", "nbf", "iss", "aud", "sub", "jti"]
# Far above any token we mint (a few hundred bytes); a cheap bound before any parsing.
MAX_TOKEN_BYTES = 4096
_JTI = re.compile(r"[A-Za-z0-9_-]{22}")  # mint's: secrets.token_urlsafe(16)


def is_jti(value: str) -> bool:
    """Whether ``value`` has the shape of the token ids this service makes."""
    return _JTI.fullmatch(value) is not None


class TokenError(Exception):
    """A token that must be refused. ``str(err)`` is safe to show: it never quotes the token."""

    def __init__(self, message: str, code: str = "invalid_token"):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SigningKey:
    kid: str
    created_at: int
    public_jwk: dict[str, str]
    private_pem: str | None = field(default=None, repr=False)
    region: str | None = None  # an imported key: the region that issued it, when its JWKS named it

    @property
    def imported(self) -> bool:
        """Another region's key: only a region's own keys have their private half here."""
        return self.private_pem is None

    @classmethod
    def generate(cls) -> "SigningKey":
        private = Ed25519PrivateKey.generate()
        pem = private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        return cls(
            kid=f"{time.strftime('%Y%m%d')}-{secrets.token_hex(4)}",
            created_at=int(time.time()),
            public_jwk=OKPAlgorithm.to_jwk(private.public_key(), as_dict=True),
            private_pem=pem,
        )

    @cached_property
    def public_key(self) -> Ed25519PublicKey:
        key = OKPAlgorithm.from_jwk(self.public_jwk)
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"signing key {self.kid} is not an Ed25519 public key")
        return key

    @cached_property
    def private_key(self) -> Ed25519PrivateKey:
        if self.private_pem is None:
            raise ValueError(f"signing key {self.kid} is verify-only")
        return serialization.load_pem_private_key(self.private_pem.encode(), password=None)

    def jwk(self, region: str | None = None) -> dict[str, str]:
        """``region``: this keyset's region, named on its own keys so an importer can bind them
        (RFC 7517 lets a JWK carry members a verifier does not know; they are ignored)."""
        jwk = {**self.public_jwk, "kid": self.kid, "alg": ALGORITHM, "use": "sig"}
        issuer = self.region if self.imported else region
        return jwk | {"region": issuer} if issuer else jwk


@dataclass(frozen=True)
class Keyset:
    keys: tuple[SigningKey, ...]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Keyset":
        return cls(tuple(SigningKey(**entry) for entry in raw["keys"]))

    def to_json(self) -> dict[str, Any]:
        return {"keys": [asdict(key) for key in self.keys]}

    def signing_key(self) -> SigningKey:
        signers = [key for key in self.keys if key.private_pem is not None]
        if not signers:
            raise ValueError("the keyset has no private key to sign with; run `serve-app signing rotate`")
        return signers[-1]  # rotation appends: the last key with a private half is the newest

    def find(self, kid: str) -> SigningKey | None:
        return next((key for key in self.keys if key.kid == kid), None)

    def jwks(self, region: str | None = None) -> dict[str, Any]:
        """The public half of this region's own keys, safe to publish at ``/.well-known/jwks.json``.
        Never the keys it imported: a region importing ours would trust every region we trust, and a
        key its own region retired (compromised) would live on in our re-export."""
        return {"keys": [key.jwk(region) for key in self.keys if not key.imported]}

    def rotated(self) -> "Keyset":
        return Keyset((*self.keys, SigningKey.generate()))

    def without(self, kid: str) -> "Keyset":
        if self.find(kid) is None:
            raise KeyError(f"no signing key {kid!r}")
        remaining = Keyset(tuple(key for key in self.keys if key.kid != kid))
        remaining.signing_key()  # refuse to leave nothing to sign with
        return remaining

    def with_imported(self, jwks: dict[str, Any], region: str | None = None) -> "Keyset":
        """Add another region's public keys (verify-only); kids already present are skipped.
        Each is bound to ``region``, else to the region its JWK names (the router's JWKS does)."""
        added = []
        for jwk in jwks["keys"]:
            if jwk.get("alg", ALGORITHM) != ALGORITHM or jwk.get("crv") != "Ed25519":
                raise ValueError(f"key {jwk.get('kid')!r} is not an EdDSA Ed25519 key")
            if self.find(jwk["kid"]) is None:
                public = {name: jwk[name] for name in ("kty", "crv", "x")}
                named = jwk.get("region") if isinstance(jwk.get("region"), str) else None
                added.append(
                    SigningKey(kid=jwk["kid"], created_at=int(time.time()), public_jwk=public, region=region or named)
                )
        return Keyset((*self.keys, *added))


# --- the keyset file -------------------------------------------------------------------------
def load_keyset(path: Path) -> Keyset:
    return Keyset.from_json(json.loads(path.read_text()))


def save_keyset(path: Path, keyset: Keyset) -> None:
    """Replace the file atomically (a router never reads half a file); private: mode 0600."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = _write_private_temp(path, keyset)
    os.replace(tmp, path)


def create_keyset(path: Path) -> Keyset:
    """A fresh keyset with one key, unless another process created one first (then that one)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = _write_private_temp(path, Keyset((SigningKey.generate(),)))
    try:
        os.link(tmp, path)  # atomic and fails if the file exists: two routers starting agree
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return load_keyset(path)


def _write_private_temp(path: Path, keyset: Keyset) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: mode 0600
    with os.fdopen(fd, "w") as out:
        json.dump(keyset.to_json(), out, indent=2)
    return tmp


class KeysetFile:
    """The keyset as a router sees it: re-read when the file changes, checked every
    ``check_interval_s``, and at once (at most once a second) when a token names an unknown kid,
    so a token signed by a key rotated in a moment ago is not refused by a stale router."""

    def __init__(self, path: Path, *, check_interval_s: float = 5, create: bool = False):
        self.path = path
        if not path.exists():
            if not create:
                raise FileNotFoundError(
                    f"signing keyset {path} does not exist; create it with "
                    "`serve-app signing rotate` (see docs/auth.md)"
                )
            create_keyset(path)
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._keyset = Keyset(())
        self._checked_at = self._forced_at = 0.0
        self._reload()

    def current(self) -> Keyset:
        if time.monotonic() - self._checked_at >= self.check_interval_s:
            self._reload()
        return self._keyset

    def find(self, kid: str) -> SigningKey | None:
        key = self.current().find(kid)
        if key is None and time.monotonic() - self._forced_at >= 1:
            self._forced_at = time.monotonic()
            key = self._reload().find(kid)
        return key

    def _reload(self) -> Keyset:
        with self._lock:
            self._checked_at = time.monotonic()
            stat = self.path.stat()
            stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                self._keyset, self._stamp = load_keyset(self.path), stamp
            return self._keyset


# --- minting and verifying ---------------------------------------------------------------------
def mint(
    keyset: Keyset,
    *,
    issuer: str,
    audience: str,
    subject: str,
    ttl_s: int,
    claims: dict[str, Any],
    not_after: int | None = None,
) -> tuple[str, dict[str, Any]]:
    """Sign a token for ``subject``; it never outlives ``not_after`` (the API key's expiry)."""
    now = int(time.time())
    expires = now + ttl_s if not_after is None else min(now + ttl_s, not_after)
    payload = {
        **claims,
        "iss": issuer,
        "aud": audience,
        "sub": subject,
        "iat": now,
        "nbf": now,
        "exp": expires,
        "jti": secrets.token_urlsafe(16),
    }
    key = keyset.signing_key()
    token = jwt.encode(payload, key.private_key, algorithm=ALGORITHM, headers={"kid": key.kid})
    return token, payload


_ERRORS: list[tuple[type[Exception], str, str]] = [
    (jwt.ExpiredSignatureError, "token has expired; mint a new one", "token_expired"),
    (jwt.ImmatureSignatureError, "token is not valid yet", "token_not_yet_valid"),
    (jwt.InvalidAudienceError, "token audience is not accepted here", "invalid_token"),
    (jwt.InvalidIssuerError, "token issuer is not trusted here", "invalid_token"),
    (jwt.InvalidSignatureError, "token signature is invalid", "invalid_token"),
    (jwt.MissingRequiredClaimError, "token lacks a required claim", "invalid_token"),
    (jwt.InvalidAlgorithmError, "token algorithm is not accepted", "invalid_token"),
    (jwt.InvalidTokenError, "token is malformed", "invalid_token"),
]


def verify(token: str, keys: KeysetFile, **checks: Any) -> dict[str, Any]:
    """The verified payload of ``token``, or TokenError; ``checks`` as for ``verify_signed``."""
    return verify_signed(token, keys, **checks)[0]


def verify_signed(
    token: str,
    keys: KeysetFile,
    *,
    issuer: str,
    audience: str | list[str],
    leeway_s: int,
    max_lifetime_s: int = MAX_TOKEN_TTL_S,
) -> tuple[dict[str, Any], SigningKey]:
    """The verified payload of ``token`` and the key that signed it (whose region it binds), or
    TokenError. Never trusts the header beyond a lookup. ``audience``: any of these is accepted
    (the token's ``aud`` must name one). ``exp - iat`` may be at most ``max_lifetime_s`` +
    ``leeway_s``: a stolen signing key, or a bug, must not yield a token that lives for years."""
    if len(token) > MAX_TOKEN_BYTES:
        raise TokenError("token is too large")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.InvalidTokenError:
        raise TokenError("token is malformed") from None
    # Checked before any key is touched: "none" and HS256-keyed-with-our-public-key die here
    # (and again in jwt.decode's allowlist).
    if header.get("alg") != ALGORITHM:
        raise TokenError(f"token algorithm is not accepted; expected {ALGORITHM}")
    kid = header.get("kid")
    # The kid is only ever a dict lookup key: never a path, URL or query.
    signing_key = keys.find(kid) if isinstance(kid, str) else None
    if signing_key is None:
        raise TokenError("token was signed by an unknown key (kid)")
    try:
        payload = jwt.decode(
            token,
            signing_key.public_key,
            algorithms=[ALGORITHM],
            audience=audience,
            issuer=issuer,
            leeway=leeway_s,
            options={"require": REQUIRED_CLAIMS},
        )
    except jwt.InvalidTokenError as err:
        message, code = next((m, c) for kind, m, c in _ERRORS if isinstance(err, kind))
        if isinstance(err, jwt.MissingRequiredClaimError):
            message = f"token lacks the {err.claim!r} claim"
        raise TokenError(message, code) from None
    # pyjwt accepts anything int() takes (even "123"); the lifetime needs real numbers.
    if not all(type(payload[name]) in (int, float) for name in ("exp", "iat")):
        raise TokenError("token claims exp and iat must be numbers")
    if payload["exp"] - payload["iat"] > max_lifetime_s + leeway_s:
        raise TokenError(f"token lifetime exceeds the {max_lifetime_s}s this region allows")
    return payload, signing_key
