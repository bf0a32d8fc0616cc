"""The one object the router asks: who is calling, may they do this, may they do it now.

``Authorization: Bearer <credential>`` carries one of three things, told apart by shape:
- a JWT minted by ``POST /v1/auth/token`` (any region's, if its keys are in our keyset): verified
  with the public key alone; where the registry holds its key, the key's row decides (revoked,
  owner, tier) and the token can only narrow it (models, regions, scopes), so a token never says
  more than the registry does and a registry edit reaches live tokens within ``cache_ttl_s``;
- a raw API key ``pgk_...`` (what an unmodified openai SDK sends as ``api_key=``): looked up in the
  key store (cached for ``cache_ttl_s``; unknown ids are bounded, ``cache.py``) and turned into the
  same claims a token would carry;
- in the local region only, the dev key from ``$SERVE_APP_DEV_API_KEY``.

Failures raise ``APIError``: 401 with ``WWW-Authenticate`` (RFC 6750), 403 for scope, model and
region, 429 with ``Retry-After`` and ``x-ratelimit-*``, 503 with ``Retry-After`` when the registry
is away or this router's budget for unknown key ids is spent (each refusal's shape: ``refusals.py``).
No message ever quotes a credential.
"""

import asyncio
import contextvars
import functools
import hmac
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from serve_app.auth import admin, tokens
from serve_app.auth.admission import Admission, Limiter
from serve_app.auth.config import LOCAL_REGION, AuthArgs
from serve_app.auth.database import RegistryUnavailable
from serve_app.auth.keys import (
    ALL,
    SCOPE_ADMIN,
    SCOPE_OPERATOR,
    SCOPES,
    CacheMiss,
    KeyStore,
    RegistryBusy,
    digest,
    is_key_id,
    looks_like_key,
)
from serve_app.auth.principal import Principal, forbidden, unauthorized
from serve_app.auth.registry_probe import RegistryProbe
from serve_app.auth.refusals import bearer, check_active, decided, logged_refusal, registry_unavailable
from serve_app.errors import APIError, retry_later
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# A forwarded request is verified when the peer receives it, within a second or two.
FORWARDING_TOKEN_TTL_S = 60
DEV_KEY_ID = "dev"
# The token endpoint's budget lives in the same limiter as inference, under its own bucket name
# (key ids are hex, so no key's inference bucket is called this), so minting costs no inference.
TOKEN_ENDPOINT_BUCKET = "token-endpoint:{key_id}"
TOKEN_REVOKE_BUCKET = "token-revoke:{key_id}"
# A spent budget for unknown key ids refills this fast: a second brings registry_miss_lookups_per_s.
REGISTRY_BUSY_RETRY_S = 1
# At most this many registry queries for unknown key ids at once, per router replica: a flood
# never holds more of the worker threads that real keys' lookups, signing and reports share.
UNKNOWN_ID_THREADS = 2
# How often a router lists the key ids created since its last listing (one indexed query): a
# key created since is the only real one a flood of made-up ids can hold back, this long at most.
KNOWN_IDS_REFRESH_S = 10
# The revocations are read from the primary every cache_ttl_s (KeyStore.follow_revocations), at most this often.
MIN_REVOCATIONS_EVERY_S = 1.0


def region_audience(audience: str, region: str) -> str:
    """The audience of a token meant for one region only (failover): every region accepts the
    shared ``audience``, but only ``region`` accepts this one."""
    return f"{audience}#{region}"


def _looks_like_jwt(credential: str) -> bool:
    return credential.count(".") == 2


class Authenticator(Admission):
    """Who is calling (here), and may they do this, now (``Admission``); the token endpoint and key
    admin."""

    def __init__(
        self,
        args: AuthArgs,
        region: str,
        limiter: Limiter,
        environ: Mapping[str, str] = os.environ,
    ):
        args.check_region(region)
        self.args, self.region, self.limiter = args, region, limiter
        # Only the local region may create missing key material; a region must be provisioned.
        create = region == LOCAL_REGION
        self.keys = KeyStore(
            args.key_store(),
            cache_ttl_s=args.cache_ttl_s,
            create=create,
            replica=args.key_store_replica(),
            miss_lookups_per_s=args.registry_miss_lookups_per_s,
        )
        # Whether the registry can be read at all, for /health (serve_app/router/operations.py).
        self.registry = RegistryProbe(self.keys.database)
        self.keyset = tokens.KeysetFile(args.signing_keys(), check_interval_s=args.cache_ttl_s, create=create)
        dev_key = environ.get(args.dev_api_key_env) if args.dev_api_key_env else None
        # Only its hash is kept, and compared in constant time like any other key.
        self._dev_key_digest = digest(dev_key) if dev_key else None
        # Tokens for everyone, and failover tokens minted by a peer for this region only.
        self._audiences = [args.audience, region_audience(args.audience, region)]
        self._charging: set[asyncio.Task] = set()
        self._following: list[asyncio.Task] = []  # the key ids' listing, the revocations' reading
        self._revocations_failed_at: float | None = None  # when a failed read was last logged
        self._revocations_thread: ThreadPoolExecutor | None = None  # while the revocations are followed
        # Made-up key ids are queried here, a few at a time (their rate: registry_miss_lookups_per_s).
        self._unknown_id_threads = ThreadPoolExecutor(UNKNOWN_ID_THREADS, thread_name_prefix="unknown-key-id")

    @staticmethod
    def authorization(headers: Any, *, api_key_header: bool = False) -> str | None:
        """The request's one credential (Starlette ``Headers``): its ``Authorization`` header, or,
        where ``api_key_header`` (Anthropic's routes), an ``x-api-key`` header as the anthropic SDK
        sends it, read as ``Bearer <value>``. Two of either, or both kinds at once, are refused:
        servers and proxies disagree on which one counts, and that disagreement is an attack."""
        values = headers.getlist("authorization")
        names = "Authorization"
        if api_key_header:
            values += [f"Bearer {value}" for value in headers.getlist("x-api-key")]
            names = "Authorization / x-api-key"
        if len(values) > 1:
            raise APIError(
                400,
                f"the request carries {len(values)} {names} headers; send exactly one credential",
                param="authorization",
                code="duplicate_authorization",
            )
        return values[0] if values else None

    # --- who is calling ---------------------------------------------------------------------
    async def authenticate_async(self, authorization: str | None, *, scope: str) -> Principal:
        """``authenticate`` for an event loop: in the loop when the key store's cache has what it
        needs (the common case), else in a worker thread, so no SQLite query blocks the loop."""
        try:
            return self.authenticate(authorization, scope=scope, offline=True)
        except CacheMiss as miss:
            query = functools.partial(self.authenticate, authorization, scope=scope)
            try:
                return await self._off_loop(query, miss)
            except RegistryUnavailable as err:
                raise registry_unavailable(err) from None

    async def _off_loop(self, query: Callable[[], Principal], miss: CacheMiss) -> Principal:
        """Run the check again where it may query: an unknown id's lookup on the threads kept for
        those (at most UNKNOWN_ID_THREADS at once; the rest queue there, never in front of real
        keys), anything else on the event loop's default threads."""
        if not miss.unknown:
            return await asyncio.to_thread(query)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._unknown_id_threads, contextvars.copy_context().run, query)

    def authenticate(self, authorization: str | None, *, scope: str, offline: bool = False) -> Principal:
        """The caller, if its credential is valid, allowed in this region and holds ``scope``.

        ``offline``: raise ``CacheMiss`` rather than query the key store."""
        with logged_refusal():
            credential = bearer(authorization)
            if _looks_like_jwt(credential):
                principal = self._from_token(credential, offline)
            else:
                principal = self._from_key(credential, offline)
            if not principal.allows_region(self.region):
                raise forbidden(f"this key is not allowed in region {self.region}", "region_not_allowed")
            if scope not in principal.scopes:
                why = f"this endpoint needs the {scope!r} scope"
                if scope == SCOPE_ADMIN and principal.signed_in is not None:
                    why += "; admin tokens are honoured only in the region that signed them"
                raise forbidden(why, "insufficient_scope", scope)
            return principal

    def _verified(self, token: str) -> tuple[dict[str, Any], tokens.SigningKey]:
        """``token``'s claims and signing key, if it is a token of this service (TokenError)."""
        return tokens.verify_signed(
            token,
            self.keyset,
            issuer=self.args.issuer,
            audience=self._audiences,
            leeway_s=self.args.leeway_s,
            # No region mints longer (they share token_ttl_s); failover tokens are shorter.
            max_lifetime_s=self.args.token_ttl_s,
        )

    def _from_token(self, token: str, offline: bool = False) -> Principal:
        try:
            claims, signing_key = self._verified(token)
        except tokens.TokenError as err:
            raise unauthorized(str(err), err.code) from None
        principal = Principal.from_claims(claims)
        if not (is_key_id(principal.key_id) or principal.key_id == DEV_KEY_ID):
            # Every token names the key it was minted for. An empty or made-up subject names none,
            # and a key id is what scopes a caller's own reads ("" once read as every key's usage).
            raise unauthorized("token subject is not a key id", "invalid_token")
        if claims["aud"] == self._audiences[1]:  # minted by a peer's router, for this region only
            principal = replace(principal, peer_bound=True)
        if self.keys.is_jti_revoked(claims["jti"], offline):
            raise unauthorized("token has been revoked", "token_revoked")
        # The row is the truth, whichever region signed: a peer's key (or our own, minted before an
        # edit) cannot claim another owner or tier. Regions share one registry, so a key it does
        # not hold never was one: its claims (owner, tier) would be a signer's word alone, which a
        # stolen peer key could use to read, bill or probe any owner. Only a dev key (``make run``) has none.
        record = self.keys.get(principal.key_id, offline)
        if record is not None:
            check_active(record)
            principal = principal.bound_to(record)
        elif principal.key_id != DEV_KEY_ID or signing_key.imported or self._dev_key_digest is None:
            raise unauthorized("token's key is not in the key registry", "invalid_token")
        if signing_key.imported:
            # Another region's key vouches for inference only: were it stolen, its holder could
            # otherwise mint admin tokens (revoke keys, unload models) valid in every region.
            principal = replace(
                principal, scopes=principal.scopes - {SCOPE_ADMIN, SCOPE_OPERATOR}, signed_in=signing_key.region or ""
            )
        return principal

    def _from_key(self, credential: str, offline: bool = False) -> Principal:
        if self._dev_key_digest is not None and hmac.compare_digest(digest(credential), self._dev_key_digest):
            return Principal(
                key_id=DEV_KEY_ID,
                owner="local-dev",
                models=frozenset({ALL}),
                regions=frozenset({LOCAL_REGION}),
                scopes=frozenset(SCOPES),
                tier=self.args.dev_tier,
                via="dev_key",
            )
        try:
            record = self.keys.lookup(credential, offline) if looks_like_key(credential) else None
        except RegistryBusy:
            # Not a 401: the key may be real (the SDK would not retry, and its owner would think it
            # wrong), and nothing was learnt about it; the openai SDK retries a 503 after Retry-After.
            raise retry_later(
                "too many lookups of API keys this router has not seen yet",
                "key_registry_busy",
                REGISTRY_BUSY_RETRY_S,
            ) from None
        if record is None:
            raise unauthorized("Incorrect API key provided", "invalid_api_key")
        check_active(record)
        return Principal.from_record(record)

    # --- background work ------------------------------------------------------------------
    def start(self) -> None:
        """List the registry's key ids now and every ``KNOWN_IDS_REFRESH_S`` (``KeyStore.
        refresh_known_ids``): their lookups never wait behind a flood of made-up ids. Read the
        revocations from the primary every ``cache_ttl_s`` (``KeyStore.follow_revocations``): a
        revoked key or token is refused within that, however far the read replica lags. Inside
        the router's event loop; the queries run on threads."""
        if not self._following:
            loop = asyncio.get_running_loop()
            self._following = [loop.create_task(self._follow_known_ids(), name="known-key-ids")]
            if getattr(self.keys.database, "replica", None):  # else every lookup reads the primary already
                self._revocations_thread = ThreadPoolExecutor(1, thread_name_prefix="revocations")
                self._following.append(loop.create_task(self._follow_revocations(), name="revocations"))

    async def aclose(self) -> None:
        await self.registry.aclose()
        self.keys.close()
        for task in self._following:
            task.cancel()
        await asyncio.gather(*self._following, return_exceptions=True)
        self._following = []
        if self._revocations_thread is not None:
            self._revocations_thread.shutdown(wait=False, cancel_futures=True)
            self._revocations_thread = None

    async def list_key_ids(self) -> None:
        """List the registry's key ids now (``KeyStore.refresh_known_ids``), on a thread; a failure
        is logged (the registry away: what is listed stays, the budget still holds)."""
        try:
            await asyncio.to_thread(self.keys.refresh_known_ids)
        except Exception as err:
            logger.warning("key registry: listing key ids failed (%s); retrying", err)

    async def _follow_known_ids(self) -> None:
        while True:
            await self.list_key_ids()
            await asyncio.sleep(KNOWN_IDS_REFRESH_S)

    async def read_revocations(self) -> None:
        """``KeyStore.follow_revocations`` on a thread; a failure is logged once a minute (the
        primary away: revocations still reach this router as its cached rows are read again)."""
        try:
            # A thread of its own: with the primary away, its 5 s connects hold none of the
            # threads the lookups and signing run on.
            await asyncio.get_running_loop().run_in_executor(self._revocations_thread, self.keys.follow_revocations)
            self._revocations_failed_at = None
        except Exception as err:
            now = time.monotonic()
            if self._revocations_failed_at is None or now - self._revocations_failed_at >= 60:
                self._revocations_failed_at = now
                logger.warning("key registry: reading the revocations from the primary failed (%s); retrying", err)

    async def _follow_revocations(self) -> None:
        while True:  # at once first: a new store (a settings change) holds no revocation yet
            await self.read_revocations()
            await asyncio.sleep(max(MIN_REVOCATIONS_EVERY_S, self.args.cache_ttl_s))

    # --- the token endpoint and key admin ---------------------------------------------------
    async def issue_token(self, authorization: str | None, api_key: str | None = None) -> dict[str, Any]:
        """Exchange an API key (never a token: a token must not be able to renew itself) for a JWT.
        The key comes from the body (``api_key``) or from the Authorization header, never both. Rate
        limited per key (``token_requests_per_minute``), checked before anything is signed."""
        with logged_refusal():
            if api_key and authorization is not None:  # which one counts is the attack (``authorization``)
                raise APIError(400, "the request carries a key in its body and an Authorization header; send "
                               "exactly one credential", param="api_key", code="duplicate_authorization")
            credential = api_key or bearer(authorization)
            if _looks_like_jwt(credential):
                raise APIError(400, "the token endpoint takes an API key, not a token", code="api_key_required")
            try:  # from the cache in the event loop; a miss queries the store in a thread
                principal = self._from_key(credential, offline=True)
            except CacheMiss as miss:
                principal = await self._off_loop(functools.partial(self._from_key, credential), miss)
            await self._admit_token_request(principal)
        # Signing and the keyset file's check stay off the event loop.
        return await asyncio.to_thread(self._mint_for, principal)

    async def _admit_token_request(self, principal: Principal, bucket: str = TOKEN_ENDPOINT_BUCKET,
                                   what: str = "token requests") -> None:
        rpm = self.args.token_requests_per_minute
        # One token dimension of capacity 1 and cost 0: only requests are counted here.
        bucket = bucket.format(key_id=principal.key_id)
        decision = decided(await self.limiter.acquire(bucket, rpm, 1, 0))
        if not decision.allowed:
            headers = {k: v for k, v in decision.headers().items() if not k.endswith("-tokens")}
            raise APIError(
                429,
                f"Too many {what} for key {principal.key_id} ({rpm}/min); a token lasts "
                f"{self.args.token_ttl_s}s, reuse it; retry in {decision.retry_after_s:.1f}s",
                code="rate_limit_exceeded",
                headers=headers,
            )

    def _mint_for(self, principal: Principal) -> dict[str, Any]:
        record = self.keys.get(principal.key_id) if principal.via == "api_key" else None
        return mint_token(self.args, self.keyset.current(), principal, record.expires_at if record else None)

    def forwarding_token(self, principal: Principal, peer_region: str) -> str:
        """A token for ``principal`` that only ``peer_region`` accepts, for failover: same subject
        and claims (as narrowed here: no admin from another region's token), its audience the
        peer alone, living at most a minute and never past the key or the caller's own token."""
        record = self.keys.get(principal.key_id) if principal.via == "api_key" else None
        ends = [t for t in (record.expires_at if record else None, principal.expires_at) if t is not None]
        token, _ = tokens.mint(
            self.keyset.current(),
            issuer=self.args.issuer,
            audience=region_audience(self.args.audience, peer_region),
            subject=principal.key_id,
            ttl_s=FORWARDING_TOKEN_TTL_S,
            claims=principal.claims(),
            not_after=min(ends) if ends else None,
        )
        return token

    def jwks(self) -> dict[str, Any]:
        # Our own keys carry our region's name, so a region importing this JWKS binds them to us.
        return self.keyset.current().jwks(self.region)

    # Key admin, as ``admin.py`` defines it: an operator manages every key, an owner admin its
    # owner's. Synchronous (the registry is queried): the routes call them in a thread.
    def list_keys(self, caller: Principal) -> list[dict[str, Any]]:
        """The keys ``caller`` may see (``GET /v1/admin/keys``)."""
        return [record.public() for record in self.keys.list_keys(owner=admin.managed_owner(caller))]

    async def key_owner(self, key_id: str) -> str | None:
        """Who owns ``key_id`` (None: no such key), from the cache, else read on a thread
        (``KeyStore.find``: a made-up id spends the budget for unknown ids, as a raw key's does)."""
        try:
            try:
                record = self.keys.find(key_id, offline=True)
            except CacheMiss as miss:
                record = await self._off_loop(functools.partial(self.keys.find, key_id), miss)
        except RegistryBusy:
            raise retry_later("too many lookups of key ids this router has not seen yet", "key_registry_busy",
                              REGISTRY_BUSY_RETRY_S) from None
        except RegistryUnavailable as err:
            raise registry_unavailable(err) from None
        return record.owner if record is not None else None

    def revoke_key(self, caller: Principal, key_id: str) -> bool:
        """Revoke ``key_id`` if ``caller`` manages it; False (the route's 404 ``key_not_found``)
        when no such key exists or it is another owner's: the two must look alike."""
        revoked = self.keys.revoke_key(key_id, owner=admin.managed_owner(caller))
        if revoked:
            logger.info("%s revoked key %s", caller.key_id, key_id)
        return revoked

    def token_to_revoke(self, caller: Principal, token: str) -> tuple[str, int] | None:
        """``token``'s jti and when its row may go, if ``caller`` may revoke it
        (``admin.may_revoke_token``); None (the route's 404) for a token of a key it does not
        manage, which must look like no token at all. TokenError if it is no token of this service."""
        claims, _ = self._verified(token)
        key_id, jti = claims["sub"], claims["jti"]
        if not (isinstance(key_id, str) and (is_key_id(key_id) or key_id == DEV_KEY_ID)):
            raise tokens.TokenError("token subject is not a key id", "invalid_token")
        if not (isinstance(jti, str) and tokens.is_jti(jti)):
            raise tokens.TokenError("token id (jti) is not one this service makes", "invalid_token")
        record = None if key_id == caller.key_id else self.keys.get(key_id)
        if not admin.may_revoke_token(caller, key_id, record.owner if record is not None else None):
            return None
        return jti, int(claims["exp"]) + self.args.leeway_s

    async def admit_revocation(self, caller: Principal) -> None:
        """A revocation's write, charged to its own per-key budget (the token endpoint's rate, a
        bucket apart): not to the key's requests, which the leaked token may be spending."""
        await self._admit_token_request(caller, TOKEN_REVOKE_BUCKET, "token revocations")


def mint_token(args: AuthArgs, keyset: tokens.Keyset, principal: Principal, not_after: int | None) -> dict[str, Any]:
    """The token endpoint's answer (OAuth 2 shape); the CLI's `token mint` uses it too."""
    token, payload = tokens.mint(
        keyset,
        issuer=args.issuer,
        audience=args.audience,
        subject=principal.key_id,
        ttl_s=args.token_ttl_s,
        claims=principal.claims(),
        not_after=not_after,
    )
    return {
        "access_token": token,
        "token_type": "Bearer",
        "expires_in": payload["exp"] - payload["iat"],
        "scope": payload["scope"],
    }
