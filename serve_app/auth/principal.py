"""Who is calling — the claims a request runs under, from a token or a key record — and how a
refusal of them looks (401 with RFC 6750's ``WWW-Authenticate``, 403 naming the missing scope).

The router, the usage meter and the Responses store take a ``Principal``; only the
``Authenticator`` (``authenticator.py``) makes one.
"""

from dataclasses import dataclass, replace
from typing import Any

from serve_app.auth.keys import ALL, KeyRecord
from serve_app.errors import APIError

REALM = "serve_app"


@dataclass(frozen=True)
class Principal:
    key_id: str
    owner: str
    models: frozenset[str]  # canonical ids; {"*"}: all
    regions: frozenset[str]  # {"*"}: all
    scopes: frozenset[str]
    tier: str
    via: str  # "token", "api_key" or "dev_key"
    expires_at: int | None = None  # a token's exp: a token minted for this caller never outlives it
    # A token signed by another region's (imported) key: that region's name, or "" when its JWKS
    # did not say. None: this region vouches for the caller (its own key, store or dev key).
    signed_in: str | None = None
    # A token whose audience is this region alone: a peer region's router minted it to fail a
    # request over here (clients are never given one). Only such a caller may hand over a stream
    # to resume (``router/resume.py``), which the forwarding region bills.
    peer_bound: bool = False

    def allows_model(self, model_id: str) -> bool:
        return ALL in self.models or model_id in self.models

    def allows_region(self, region: str) -> bool:
        return ALL in self.regions or region in self.regions

    @classmethod
    def from_record(cls, record: KeyRecord) -> "Principal":
        return cls(
            key_id=record.key_id,
            owner=record.owner,
            models=frozenset(record.models),
            regions=frozenset(record.regions),
            scopes=frozenset(record.scopes),
            tier=record.tier,
            via="api_key",
        )

    def bound_to(self, record: KeyRecord) -> "Principal":
        """A verified token's principal as its key's registry row allows it: owner and tier from
        the row; models, regions and scopes the token's within the row's (a token may narrow what
        its key allows, never widen it)."""
        return replace(
            self,
            owner=record.owner,
            tier=record.tier,
            models=_within(self.models, frozenset(record.models)),
            regions=_within(self.regions, frozenset(record.regions)),
            scopes=self.scopes & frozenset(record.scopes),
        )

    def claims(self) -> dict[str, Any]:
        """What a token minted for this caller asserts besides the registered claims."""
        return {
            "owner": self.owner,
            "models": sorted(self.models),
            "regions": sorted(self.regions),
            "tier": self.tier,
            "scope": " ".join(sorted(self.scopes)),  # OAuth style: space-separated
        }

    @classmethod
    def from_claims(cls, claims: dict[str, Any]) -> "Principal":
        """The inverse of ``claims()`` for a verified token; wrong types are a 401, not a 500."""
        strings = [claims.get(name) for name in ("sub", "owner", "tier", "scope")]
        lists = [claims.get(name) for name in ("models", "regions")]
        if not all(isinstance(v, str) for v in strings) or not all(
            isinstance(v, list) and all(isinstance(i, str) for i in v) for v in lists
        ):
            raise unauthorized("token claims are malformed", "invalid_token")
        sub, owner, tier, scope = strings
        return cls(
            sub, owner, frozenset(lists[0]), frozenset(lists[1]), frozenset(scope.split()), tier, "token",
            expires_at=int(claims["exp"]),
        )


def _within(claimed: frozenset[str], allowed: frozenset[str]) -> frozenset[str]:
    """``claimed`` ∩ ``allowed``, where ``{"*"}`` is everything."""
    if ALL in allowed:
        return claimed
    return allowed if ALL in claimed else claimed & allowed


def unauthorized(message: str, code: str, error: str | None = "invalid_token") -> APIError:
    challenge = f'Bearer realm="{REALM}"'
    if error:  # RFC 6750 §3.1: no error attribute when the request carried no credential at all
        challenge += f', error="{error}", error_description="{message}"'
    return APIError(401, message, code=code, headers={"WWW-Authenticate": challenge})


def forbidden(message: str, code: str, scope: str | None = None) -> APIError:
    challenge = f'Bearer realm="{REALM}", error="insufficient_scope"' + (f', scope="{scope}"' if scope else "")
    return APIError(403, message, code=code, headers={"WWW-Authenticate": challenge})
