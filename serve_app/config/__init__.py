"""The application's arguments (the ``args:`` block of a Serve config), validated with pydantic.

Every model rejects unknown keys, so a typo in a Serve config fails the deploy with a message that
names the key instead of being silently ignored. Nothing here imports Ray or vLLM: unit tests and
the CLI use it directly.
"""

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from serve_app.auth.config import AuthArgs
from serve_app.config.media import ENGINE_ENV, MEDIA_FLAGS, MEDIA_OFF_HOST, MediaPolicy
from serve_app.config.model import (
    REQUEST_TIMEOUT_S,
    ROUTER_BACKOFF_S,
    TINY_MODEL_SOURCE,
    Autoscaling,
    EngineOverrides,
    ModelDeploymentArgs,
    Resources,
    Routing,
    replica_bounds_problem,
    request_router_config,
)
from serve_app.config.router import (
    MAX_STORED_RESPONSE_BYTES,
    FailoverArgs,
    Peer,
    ResponsesArgs,
    RouterArgs,
    UsageArgs,
)
from serve_app.settings import Settings, describe_errors, listed_twice
from serve_app.telemetry.config import TelemetryArgs

__all__ = [
    "ENGINE_ENV", "MAX_STORED_RESPONSE_BYTES", "MEDIA_FLAGS", "MEDIA_OFF_HOST", "REQUEST_TIMEOUT_S",
    "ROUTER_BACKOFF_S", "TINY_MODEL_SOURCE", "AppArgs", "Autoscaling", "EngineOverrides", "FailoverArgs",
    "MediaPolicy", "ModelDeploymentArgs", "Peer", "Resources", "ResponsesArgs", "RouterArgs", "Routing",
    "UsageArgs", "parse_app_args", "replica_bounds_problem", "request_router_config",
]


class AppArgs(Settings):
    region: str = Field("local", description="Region id reported in responses and traces.")
    models: list[ModelDeploymentArgs] = Field(min_length=1)
    router: RouterArgs = Field(default_factory=RouterArgs)
    auth: AuthArgs = Field(default_factory=AuthArgs)
    telemetry: TelemetryArgs = Field(default_factory=TelemetryArgs)
    failover: FailoverArgs = Field(default_factory=FailoverArgs)
    responses: ResponsesArgs = Field(default_factory=ResponsesArgs)
    usage: UsageArgs = Field(default_factory=UsageArgs)

    def usage_spool_dir(self) -> Path:
        if self.usage.spool_dir:
            return Path(self.usage.spool_dir)
        return self.auth.key_store_sqlite().parent / "usage-spool"

    @model_validator(mode="after")
    def _auth_fits_region(self) -> "AppArgs":
        self.auth.check_region(self.region)  # regions: real key material, never the dev key
        peers = [peer.region for peer in self.failover.peers]
        if self.region in peers:
            raise ValueError(f"failover.peers: region {self.region!r} cannot fail over to itself")
        if twice := listed_twice(peers):
            raise ValueError(f"failover.peers: listed twice: {', '.join(twice)}")
        return self

    @field_validator("models")
    @classmethod
    def _unique(cls, models: list[ModelDeploymentArgs]) -> list[ModelDeploymentArgs]:
        ids = [m.id for m in models]
        if twice := listed_twice(ids):
            raise ValueError(f"model ids listed twice: {', '.join(twice)}")
        return models


def parse_app_args(raw: dict[str, Any]) -> AppArgs:
    """Validate a Serve config's ``args``; ValueError carries a readable list of the problems."""
    try:
        return AppArgs.model_validate(raw)
    except ValidationError as err:
        problems = "\n".join(f"  {line}" for line in describe_errors(err, "args"))
        raise ValueError("invalid application args:\n" + problems) from None
