"""Authentication and authorization for the router: API keys, EdDSA JWTs, scopes, rate limits.

``keys`` (key format, the registry on SQLite or PostgreSQL, ``database``), ``tokens`` (signing
keyset, JWKS, mint/verify), ``ratelimit`` and ``lease`` (token buckets, the region's shared
limiter actor, routers' leases of it), ``principal`` (who is calling, and how a refusal looks),
``authenticator`` (what the router calls), ``config`` (``AuthArgs``). See docs/auth.md and docs/threat-model.md.
"""
