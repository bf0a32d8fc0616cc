"""Authentication and authorization for the router: API keys, EdDSA JWTs, scopes, rate limits.

``keys`` (key format, hashed SQLite store), ``tokens`` (signing keyset, JWKS, mint/verify),
``ratelimit`` (token buckets, the region's shared limiter actor), ``authenticator`` (what the
router calls), ``config`` (``AuthArgs``). See docs/auth.md and docs/threat-model.md.
"""
