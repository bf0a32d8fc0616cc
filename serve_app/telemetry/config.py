"""``telemetry:`` in a Serve config's args: where traces go and whether metrics are recorded.

Validated like every other block of ``args`` (unknown keys are rejected with their path). Secrets
never need to be in the YAML: ``headers_env`` names environment variables whose values become
exporter headers, read in the router replica when tracing starts (``serve_app.telemetry.tracing``).
Nothing here imports Ray or OpenTelemetry.
"""

import os
import re
from typing import Literal
from urllib.parse import urlparse

from pydantic import ConfigDict, Field, field_validator, model_validator

from serve_app.settings import Settings

# HTTP header names (RFC 9110 token) — also valid gRPC metadata keys once lower-cased.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TracingArgs(Settings):
    """OpenTelemetry tracing of every inference request, exported over OTLP.

    Off by default: a deployment opts in by naming its collector. The router replicas own the
    process-wide tracer provider (see docs/operations.md, "Who owns the tracer provider").
    """

    # An endpoint's userinfo or query, a static header: a validation error must not echo them.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    enabled: bool = False
    endpoint: str | None = Field(
        None,
        description="OTLP receiver URL. http/protobuf: the traces URL, e.g. "
        "http://otel-collector:4318/v1/traces (a bare http://host:4318 gets /v1/traces appended). "
        "grpc: http://host:4317 (plaintext) or https://host:4317 (TLS). None: the OTel SDK's "
        "OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT environment variables, else its localhost default.",
    )
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Static exporter headers (e.g. X-Scope-OrgID for Tempo). Not for secrets: "
        "use headers_env.",
    )
    headers_env: dict[str, str] = Field(
        default_factory=dict,
        description="Header name -> name of an environment variable holding its value (e.g. "
        "Authorization: TEMPO_AUTH_HEADER). Read in the router replica at start; a missing "
        "variable fails the replica with a message naming it.",
    )
    sampling_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of traces recorded, decided on the trace id (TraceIdRatioBased), also for "
        "a request that arrives with a traceparent: its trace id is continued, its sampled flag is "
        "not followed (anyone can set it).",
    )
    service_name: str = Field("serve_app", min_length=1)
    resource_attributes: dict[str, str] = Field(
        default_factory=dict,
        description="Extra OTel resource attributes (e.g. deployment.environment: prod). They "
        "override the defaults serve_app sets (cloud.region, service.instance.id, ...).",
    )
    export_timeout_s: float = Field(10, gt=0, le=60, description="Per-batch OTLP export timeout.")

    @field_validator("endpoint")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parsed = urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            # Not echoed: its userinfo or query may hold a credential.
            raise ValueError("must be an http:// or https:// URL with a host")
        return value

    @field_validator("headers", "headers_env")
    @classmethod
    def _header_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid header name")
        return value

    @field_validator("headers_env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for header, env in value.items():
            if not _ENV_NAME.match(env):
                raise ValueError(f"headers_env.{header}: {env!r} is not an environment variable name")
        return value

    @field_validator("resource_attributes")
    @classmethod
    def _service_name_has_its_own_key(cls, value: dict[str, str]) -> dict[str, str]:
        if "service.name" in value:
            raise ValueError("set the service name with tracing.service_name, not resource_attributes")
        return value

    @model_validator(mode="after")
    def _no_header_twice(self) -> "TracingArgs":
        both = {h.lower() for h in self.headers} & {h.lower() for h in self.headers_env}
        if both:
            raise ValueError(f"header(s) set in both headers and headers_env: {', '.join(sorted(both))}")
        return self

    def resolved_headers(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """Static headers plus the values of ``headers_env``'s variables (KeyError names a missing one)."""
        environ = os.environ if environ is None else environ
        headers = dict(self.headers)
        for header, env in self.headers_env.items():
            value = environ.get(env)
            if value is None:
                raise KeyError(
                    f"telemetry.tracing.headers_env.{header} names the environment variable {env}, "
                    "which is not set in this process (set it in the router's runtime env)"
                )
            headers[header] = value
        return headers

    def resolved_endpoint(self) -> str | None:
        """The URL handed to the exporter: http/protobuf gets ``/v1/traces`` when only a base is given."""
        if self.endpoint is None or self.protocol != "http/protobuf":
            return self.endpoint
        parsed = urlparse(self.endpoint)
        if parsed.path in ("", "/"):
            return self.endpoint.rstrip("/") + "/v1/traces"
        return self.endpoint


def redacted_url(url: str) -> str:
    """``scheme://host[:port]/path`` of ``url``, for a log line: no userinfo, query or fragment,
    where a collector's credential may be (``https://user:token@host/v1/traces?api_key=…``)."""
    parsed = urlparse(url)
    host = parsed.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    try:
        port = f":{parsed.port}" if parsed.port is not None else ""
    except ValueError:  # not a number: left out
        port = ""
    return f"{parsed.scheme}://{host}{port}{parsed.path}"


class MetricsArgs(Settings):
    """Prometheus metrics through Ray's metrics agent (``ray_serve_app_*`` series)."""

    enabled: bool = True


class TelemetryArgs(Settings):
    # The outer model's setting is the one pydantic applies (the router validates this one alone).
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    tracing: TracingArgs = Field(default_factory=TracingArgs)
    metrics: MetricsArgs = Field(default_factory=MetricsArgs)
