"""``auth:`` in a Serve config's args: where keys live, who issues tokens, rate-limit tiers.

There is deliberately no switch that turns authentication off. The only relaxation is the local
dev key (``dev_api_key_env``), and ``AppArgs`` refuses it for any region other than ``local``.
"""

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from serve_app.paths import state_dir
from serve_app.settings import Settings

LOCAL_REGION = "local"
# The longest lifetime a region may configure for its tokens (``token_ttl_s``).
MAX_TOKEN_TTL_S = 3600


class Tier(Settings):
    requests_per_minute: int = Field(gt=0)
    tokens_per_minute: int = Field(gt=0)
    # vLLM's request priority under contention (--scheduling-policy priority): lower is scheduled
    # first. A request may lower its own (a larger number), never raise it above its tier's.
    priority: int = Field(0, ge=0)


DEFAULT_TIERS = {
    "free": Tier(requests_per_minute=20, tokens_per_minute=40_000, priority=20),
    "standard": Tier(requests_per_minute=600, tokens_per_minute=1_000_000, priority=10),
    "enterprise": Tier(requests_per_minute=6_000, tokens_per_minute=10_000_000, priority=0),
    # Throughput, not latency: scheduled after every interactive tier when the engine is full.
    "batch": Tier(requests_per_minute=600, tokens_per_minute=10_000_000, priority=100),
    # The local dev key's tier: generous, never the thing a developer trips over.
    "dev": Tier(requests_per_minute=100_000, tokens_per_minute=1_000_000_000, priority=10),
}


class AuthArgs(Settings):
    key_store_path: str | None = Field(
        None,
        description="SQLite API-key store (absolute path). Default, local region only: "
        "<repo>/.state/keys.sqlite3, created on first start.",
    )
    key_registry_dsn_env: str | None = Field(
        None,
        description="Name of an env var holding a postgresql:// DSN (a Kubernetes Secret in a "
        "region): the key registry every region shares. When set it replaces key_store_path.",
    )
    key_registry_read_dsn_env: str | None = Field(
        None,
        description="Name of an env var holding a postgresql:// DSN of the registry's read replica "
        "nearest this region: key lookups, revocation checks, usage reports and budget spend are "
        "read there, while writes go to key_registry_dsn_env. Unset or empty: all on the primary.",
    )
    signing_keys_path: str | None = Field(
        None,
        description="Signing keyset JSON (absolute path). Default, local region only: "
        "<repo>/.state/signing-keys.json, created on first start.",
    )
    # Every region that should accept each other's tokens uses the same issuer and audience.
    issuer: str = Field("serve_app", min_length=1)
    audience: str = Field("serve_app", min_length=1)
    # Also the longest lifetime (exp - iat, plus leeway_s) a token may have to be accepted here:
    # regions that trust each other's tokens use the same value (region files render 900).
    token_ttl_s: int = Field(900, ge=60, le=MAX_TOKEN_TTL_S, description="Lifetime of a minted JWT.")
    leeway_s: int = Field(30, ge=0, le=120, description="Clock skew tolerated on exp/nbf/iat.")
    # How stale a router's view of the key store and keyset may be: CLI edits (create, revoke,
    # rotate) reach every router within this many seconds, without a restart.
    cache_ttl_s: float = Field(5, ge=0, le=60)
    # Each router replica's bound on registry queries for raw keys whose id it holds no row for
    # (a made-up id, or a real key it has not seen yet), as many at once: anyone can send a
    # well-formed key. Past it, such a key is a 503 key_registry_busy with Retry-After: 1 and
    # nothing is queried; keys the router holds a row for, and tokens, are never held back.
    registry_miss_lookups_per_s: float = Field(100, gt=0, le=10_000)
    # POST /v1/auth/token per key, region-wide: a client needs one token per token_ttl_s, so this
    # only ever stops a loop (or a stolen key) from spending the router's CPU on signatures.
    token_requests_per_minute: int = Field(60, ge=1, le=10_000)
    tiers: dict[str, Tier] = Field(default_factory=lambda: dict(DEFAULT_TIERS))
    default_tier: str = "standard"
    dev_api_key_env: str | None = Field(
        None,
        description="Name of an env var whose value is accepted as an all-access API key. "
        "Only allowed in the local region.",
    )
    dev_tier: str = "dev"

    @field_validator("key_store_path", "signing_keys_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        # Ray workers do not share the deployer's working directory: a relative path would
        # point somewhere different in every process.
        if value is not None and not Path(value).is_absolute():
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @model_validator(mode="after")
    def _tiers_exist(self) -> "AuthArgs":
        for name in (self.default_tier, self.dev_tier):
            if name not in self.tiers:
                raise ValueError(f"tier {name!r} is not defined in tiers ({', '.join(self.tiers)})")
        return self

    def check_region(self, region: str) -> None:
        """Regions run with real key material and no dev key; only ``local`` may use defaults."""
        if region == LOCAL_REGION:
            return
        if self.dev_api_key_env:
            raise ValueError(f"dev_api_key_env is only allowed in the {LOCAL_REGION!r} region")
        missing = [n for n in ("key_store_path", "signing_keys_path") if getattr(self, n) is None]
        if self.key_registry_dsn_env:
            missing = [n for n in missing if n != "key_store_path"]
        if missing:
            raise ValueError(f"region {region!r} must set {' and '.join(missing)}")

    def key_store(self, environ: Mapping[str, str] | None = None) -> Path | str:
        """The registry: the DSN in ``key_registry_dsn_env``, or the SQLite file."""
        if self.key_registry_dsn_env:
            dsn = (os.environ if environ is None else environ).get(self.key_registry_dsn_env, "").strip()
            if not dsn:
                raise ValueError(
                    f"the key registry's DSN is named as ${self.key_registry_dsn_env}, which is empty here "
                    "(set it from the region's registry Secret)"
                )
            return dsn
        return self.key_store_sqlite()

    def key_store_replica(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The registry's nearest read replica (a DSN), or None: reads go to the primary."""
        if not (self.key_registry_dsn_env and self.key_registry_read_dsn_env):
            return None
        return (os.environ if environ is None else environ).get(self.key_registry_read_dsn_env, "").strip() or None

    def key_store_sqlite(self) -> Path:
        return Path(self.key_store_path) if self.key_store_path else state_dir() / "keys.sqlite3"

    def signing_keys(self) -> Path:
        return Path(self.signing_keys_path) if self.signing_keys_path else state_dir() / "signing-keys.json"
