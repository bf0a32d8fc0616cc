"""The application's arguments (the ``args:`` block of a Serve config), validated with pydantic.

Every model rejects unknown keys, so a typo in a Serve config fails the deploy with a message that
names the key instead of being silently ignored. Nothing here imports Ray or vLLM: unit tests and
the CLI use it directly.
"""

import ipaddress
import json
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator

from serve_app import catalog
from serve_app.auth.config import AuthArgs
from serve_app.settings import Settings, describe_errors, listed_twice
from serve_app.telemetry.config import TelemetryArgs

TINY_MODEL_SOURCE = "tiny-local"
# Serve's bound on one HTTP request, streams included (every config's http_options.request_timeout_s):
# a replica stopped with this long to finish its requests drops none (docs/operations.md, "Upgrades").
REQUEST_TIMEOUT_S = 600


def replica_bounds_problem(
    low: int, initial: int | None, high: int, names: tuple[str, str, str]
) -> str | None:
    """What breaks min <= initial <= max in autoscaling bounds, or None; ``names`` spell min,
    initial and max as the settings at hand do (the app's args here, a region file's replicas)."""
    min_name, initial_name, max_name = names
    if low > high:
        return f"{min_name} ({low}) > {max_name} ({high})"
    if initial is not None and not low <= initial <= high:
        return f"{initial_name} ({initial}) is not within [{min_name} {low}, {max_name} {high}]"
    return None


class Autoscaling(Settings):
    """Ray Serve autoscaling on in-flight requests per replica.

    Explicit numbers on purpose: Ray Serve LLM's defaults (1e9 ongoing requests) mean a replica
    never looks busy, so nothing ever scales out.
    """

    # At least one while loaded; a model that should run no replicas is unloaded (state cold).
    min_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8, gt=0)
    upscale_delay_s: float = Field(15, ge=0)
    downscale_delay_s: float = Field(300, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        names = ("min_replicas", "initial_replicas", "max_replicas")
        if problem := replica_bounds_problem(self.min_replicas, self.initial_replicas, self.max_replicas, names):
            raise ValueError(problem)
        return self


class Routing(Settings):
    """How the router replicas pick a model replica for each request: Serve's request router for
    the model's deployment (serve_app/routing/router.py; docs/operations.md, "Request routing")."""

    # prefix_affinity: a session, then the longest cached prefix, within the load bounds below;
    # default: Serve's own power of two choices.
    policy: Literal["prefix_affinity", "default"] = "prefix_affinity"
    # A replica this full (of max_ongoing_requests) takes no affinity request...
    saturated_fraction: float = Field(0.5, gt=0, le=1)
    # ...nor one for a prefix when it is this much fuller than the least loaded replica.
    max_imbalance_fraction: float = Field(0.25, ge=0, le=1)
    # A prefix shorter than this share of the prompt does not count.
    min_match_fraction: float = Field(0.1, ge=0, le=1)
    block_chars: int = Field(256, ge=16)  # the index's block of prompt characters (≈ 64 tokens)
    # What one engine's prefix cache holds, in prompt characters (~4 × its KV capacity in tokens).
    replica_cache_chars: int = Field(2_000_000, ge=1)
    max_index_blocks: int = Field(100_000, ge=1)  # the index's bound, every replica together
    max_sessions: int = Field(100_000, ge=1)  # session pins kept (LRU)
    # A session whose key falls in the default arm is routed by Serve's policy: the A/B of
    # `serve-app bench-agent --routing` on one deployment.
    compare_with_default: bool = False


# How soon Serve's router polls again for a free replica when every one it ranked was full
# (Serve: 25 ms, doubling to 0.5 s); a slot frees every engine step, so waits stay short.
ROUTER_BACKOFF_S = {"initial_backoff_s": 0.005, "backoff_multiplier": 2.0, "max_backoff_s": 0.05}


def request_router_config(routing: Routing) -> dict[str, Any]:
    """The model deployment's ``request_router_config`` (Serve's ``RequestRouterConfig``)."""
    config: dict[str, Any] = dict(ROUTER_BACKOFF_S)
    if routing.policy == "prefix_affinity":
        config |= {
            "request_router_class": "serve_app.routing.router:PrefixAffinityRouter",
            "request_router_kwargs": routing.model_dump(exclude={"policy"}),
        }
    return config


class Resources(Settings):
    """What one model replica asks Ray for. GPU replicas pin a Blackwell type per region."""

    num_cpus: float = Field(1, ge=0)
    num_gpus: float = Field(
        0, ge=0, le=1,
        description="A GPU, or a fraction of one that another model's replica shares (Ray packs fractions "
        "onto one GPU; the engine's gpu_memory_utilization must fit its fraction: docs/regions.md).",
    )
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. B200.")
    env: dict[str, str] = Field(default_factory=dict, description="Env vars for the replica.")

    @model_validator(mode="after")
    def _accelerator_needs_gpu(self) -> "Resources":
        if self.accelerator_type and not self.num_gpus:
            raise ValueError("accelerator_type is set but num_gpus is 0")
        return self


class EngineOverrides(Settings):
    """Per-deployment changes to the catalog's engine settings; None keeps the catalog value."""

    source: str | None = Field(
        None,
        description=f"Weights: a local path, a HF repo id, or {TINY_MODEL_SOURCE!r} for the "
        "generated tiny model. Default: the catalog's production checkpoint.",
    )
    max_model_len: int | None = Field(None, gt=0)
    enforce_eager: bool | None = None
    dtype: str | None = None
    quantization: str | None = None
    tool_call_parser: str | None = None
    tool_strict_level: str | None = None
    reasoning_parser: str | None = None
    max_num_seqs: int | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    extra_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Further vLLM flags by name (as `vllm serve` spells them, without --).",
    )


# With media off the engine still gets --allowed-media-domains, naming only this host: `.invalid`
# never resolves (RFC 6761), so an image URL that got past the router is refused by vLLM
# before any fetch (an empty list would mean "every host" to vLLM).
MEDIA_OFF_HOST = "media-off.invalid"
# vLLM flags the media policy sets (or keeps unset): extra_args may not override them.
MEDIA_FLAGS = ("allowed-media-domains", "allowed-local-media-path")
# The replica's environment whatever the config: vLLM follows a media URL's redirects by
# default, and an allowed host could redirect into the cluster.
ENGINE_ENV = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\.)+[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Names that resolve inside a cluster or a host, never to a public media server.
_INTERNAL_SUFFIXES = (".local", ".localhost", ".internal", ".svc", ".invalid", ".test", ".example", ".arpa")


class MediaPolicy(Settings):
    """Which media (images, audio, video) a model's requests may carry (docs/regions.md, "Media").

    ``off`` (the default, and ``media: off`` in YAML): the router refuses every content part that
    is not text (400 ``media_not_allowed``) and the engine fetches nothing (``MEDIA_OFF_HOST``).
    ``allowed_domains``: image, audio and video parts may name an http(s) URL whose host is exactly
    one of these (vLLM's own comparison: no subdomains, no wildcards), or carry the media inline
    (a base64 ``data:`` URL); the engine gets the same list as ``--allowed-media-domains``.
    """

    allowed_domains: tuple[str, ...] = Field(
        (), description="Hosts media URLs may name, exactly; empty: media off.", max_length=64
    )

    @model_validator(mode="before")
    @classmethod
    def _off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false.
        if value is False or value == "off":
            return {}
        if value is True or value == "on":
            raise ValueError("media is 'off' or {allowed_domains: [host, ...]}: name the hosts media may come from")
        return value

    @field_validator("allowed_domains")
    @classmethod
    def _public_hostnames(cls, domains: tuple[str, ...]) -> tuple[str, ...]:
        for domain in domains:
            if _is_ip(domain):
                raise ValueError(f"{domain!r}: name a host, not an IP address")
            if not _HOSTNAME.match(domain):
                raise ValueError(f"{domain!r} is not a lower-case host name like cdn.example.com (no scheme, port or path)")
            if domain.endswith(_INTERNAL_SUFFIXES):
                raise ValueError(f"{domain!r} is a cluster- or host-internal name; media must come from public hosts")
        if twice := listed_twice(domains):
            raise ValueError(f"listed twice: {', '.join(twice)}")
        return domains

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_domains)

    def engine_domains(self) -> list[str]:
        """``--allowed-media-domains``: the allow-list, or with media off a host that never resolves."""
        return list(self.allowed_domains) or [MEDIA_OFF_HOST]


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        return False
    return True


class ModelDeploymentArgs(Settings):
    id: str = Field(description="Canonical catalog id; callers may also use its aliases.")
    engine: EngineOverrides = Field(default_factory=EngineOverrides)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    resources: Resources = Field(default_factory=Resources)
    routing: Routing = Field(default_factory=Routing)
    # Requests one replica admits into vLLM at once: the engine batches them continuously.
    max_ongoing_requests: int = Field(32, ge=1)
    # Requests a router may hold waiting for a replica before it sheds load (503, Retry-After).
    max_queued_requests: int = Field(64, ge=1)  # Serve: -1 (unbounded) or >= 1
    # How long a replica being stopped (scaled down, unloaded, replaced by an upgrade) may take to
    # finish its requests before Serve kills it: by default as long as any request may last.
    graceful_shutdown_timeout_s: float = Field(REQUEST_TIMEOUT_S, ge=0)
    # Serve replaces a replica after 3 failed health checks in a row; the check asks vLLM whether
    # its engine core is alive (an instant answer), so a dead engine is found within 3 periods.
    # Serve's default period, 10 s, kept a dead replica in rotation for ~30 s (docs/reliability.md).
    health_check_period_s: float = Field(2, gt=0)
    # A check that hangs this long fails; generous, so a replica busy with a long prefill on CPU
    # is not replaced for being slow.
    health_check_timeout_s: float = Field(30, gt=0)
    initial_state: Literal["loaded", "cold"] = Field(
        "loaded",
        description="At deploy: loaded starts replicas; cold starts none until POST /v1/models/load "
        "(serve_app/hot_load/state.py). A state set through the API outlives redeploys.",
    )
    default_max_tokens: int | None = Field(
        None,
        gt=0,
        description="The completion limit the router sets (and charges) on a request that sets none; "
        "default: the catalog's. At most the served max_model_len.",
    )
    media: MediaPolicy = Field(default_factory=MediaPolicy, description="off, or {allowed_domains: [...]}.")

    @field_validator("id")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in catalog.CATALOG:
            raise ValueError(
                f"{value!r} is not a canonical catalog id (known: {', '.join(catalog.CATALOG)})"
            )
        return value

    @model_validator(mode="after")
    def _default_within_context(self) -> "ModelDeploymentArgs":
        if self.default_max_tokens is not None and catalog.get(self.id).task != "generate":
            raise ValueError(f"default_max_tokens: {self.id} is an embedding model; it generates nothing")
        if self.default_max_tokens is not None and self.default_max_tokens > self.max_model_len:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) is over the served max_model_len ({self.max_model_len})"
            )
        return self

    @property
    def max_model_len(self) -> int:
        """The served context: this deployment's override, else the catalog's."""
        return self.engine.max_model_len or catalog.get(self.id).engine.max_model_len

    @property
    def completion_default(self) -> int | None:
        """The limit of a request that sets none: this deployment's ``default_max_tokens``, else
        the catalog's, lowered to a ``max_model_len`` override that is smaller (None: an
        embedding model, which generates nothing)."""
        default = self.default_max_tokens or catalog.get(self.id).default_max_tokens
        return None if default is None else min(default, self.max_model_len)

    @model_validator(mode="after")
    def _media_flags_from_policy(self) -> "ModelDeploymentArgs":
        overridden = [name for name in self.engine.extra_args if name.replace("_", "-") in MEDIA_FLAGS]
        if overridden:
            raise ValueError(
                f"engine.extra_args: {', '.join(overridden)} cannot be set here; the media policy sets it (`media`)"
            )
        return self

    @property
    def deployment_name(self) -> str:
        return self.deployment_name_of(self.id)

    @staticmethod
    def deployment_name_of(model_id: str) -> str:
        """The model's Serve deployment (in its own application, serve_app/regions/layout.py)."""
        return f"model-{model_id}"

    def engine_cli_args(self, model_path: str) -> list[str]:
        """The vLLM flags for this deployment, exactly as ``vllm serve`` takes them.

        The replica parses them with vLLM's own argument parser, so the in-process engine and a
        bare ``vllm serve`` baseline given the same flags are configured identically.
        """
        entry = catalog.get(self.id)
        settings = entry.engine.model_dump() | self.engine.model_dump(
            exclude_none=True, exclude={"source", "extra_args"}
        )
        flags: dict[str, Any] = {
            "model": model_path,
            "served-model-name": self.id,
            **{key.replace("_", "-"): value for key, value in settings.items()},
        }
        if entry.task == "generate":
            flags |= {
                # Thinking is off unless a request opts in (the qwen3 reasoning parser otherwise
                # swallows content, tool calls and JSON output as reasoning).
                "default-chat-template-kwargs": {"enable_thinking": entry.thinking_by_default},
                "enable-auto-tool-choice": bool(settings.get("tool_call_parser")),
                # The prompt's cached tokens in every route's usage (chat and completions
                # prompt_tokens_details.cached_tokens, Messages cache_read_input_tokens): vLLM
                # leaves them out unless asked; Responses reports them either way.
                "enable-prompt-tokens-details": True,
            }
        flags |= {
            # Engine queue/prefill/decode durations per request: the replica turns them into the
            # trace spans and the timing returned to the client (serve_app/engine/trailer.py).
            "enable-per-request-metrics": True,
            # What the engine may fetch: the media policy's hosts only (never local files).
            "allowed-media-domains": self.media.engine_domains(),
            **self.engine.extra_args,
        }
        args: list[str] = []
        for name, value in flags.items():
            if value is None:
                continue
            if value is False:  # vLLM's boolean flags all take the --no- form
                args.append(f"--no-{name}")
            elif value is True:
                args.append(f"--{name}")
            elif isinstance(value, list):  # nargs="+"
                args += [f"--{name}", *map(str, value)]
            elif isinstance(value, dict):  # vLLM's JSON-valued flags
                args += [f"--{name}", json.dumps(value)]
            else:
                args += [f"--{name}", str(value)]
        return args


class RouterArgs(Settings):
    num_replicas: int = Field(1, ge=1)
    # A stream's client that reads nothing for this long (its socket open: a half-open client) is
    # cut, and its engine request stopped and billed what it generated (router/client_socket.py).
    stall_timeout_s: float = Field(30, gt=0, le=600)
    # On: a stream served by a model replica on the router's node is written by the replica
    # straight to the client's connection, which the router hands it (wire/handoff.py): no router
    # process touches its tokens. Off (the default): the router relays them. Measured on the 2-core
    # host the hand-off moves the per-token socket cost from the router to the replica and gains no
    # throughput (docs/benchmarks.md, "The hand-off"); it pays where routers are short of CPU.
    hand_off_streams: bool = False
    # How a request reaches its model replica. "direct" (the default): for a model with one running
    # replica and none stopping, on that replica's own direct line, a connection to its byte
    # listener that the router keeps open (wire/line.py, router/lines.py), once a head has named
    # it; through Serve's handle over gRPC otherwise — two replicas or more (Serve's request router
    # places each call by prefix affinity and session), a resumed stream, and any call the line
    # does not take (a full or stopping replica). Measured on the 2-core host it takes ~3 ms (the handle call's cost) off a stream's
    # TTFT at one stream (docs/benchmarks.md, "The direct line"); what it gives up and how each is
    # kept: docs/architecture.md.
    # "grpc": every call through the handle, by Serve's by-value transport (a gRPC call to the
    # replica's inter-deployment server, ``_by_reference=False``); "actor": as a Ray actor task,
    # whose items pass through both processes' core workers (gRPC is ~1.7 ms faster at one
    # stream, "The handle's transport"). Both keep Serve's routing, admission
    # (max_ongoing_requests), metrics and cancellation for every call.
    handle_transport: Literal["direct", "grpc", "actor"] = "direct"
    # A stream whose engine fails mid-answer is resumed on another replica of the region this
    # many times at most, each within resume_window_s of the failure (router/resume.py). The
    # region's replicas are tried for resume_here_s (longer than a model's health check period,
    # so that Serve has stopped routing to the dead one), then a peer region's.
    max_resumes: int = Field(1, ge=0, le=3)
    resume_window_s: float = Field(30, gt=0, le=300)
    resume_here_s: float = Field(5, gt=0, le=300)
    # The router does little CPU work; a whole CPU would starve the model replica on small hosts
    # (on a 2-CPU machine Ray could never place both).
    num_cpus: float = Field(0.1, ge=0)
    max_ongoing_requests: int = Field(1000, ge=1)
    # A router replica being replaced relays its streams to their end first (docs/operations.md).
    graceful_shutdown_timeout_s: float = Field(REQUEST_TIMEOUT_S, ge=0)


# One stored response with its conversation, as JSON, at most (a bigger one is answered, not stored).
MAX_STORED_RESPONSE_BYTES = 4 * 1024 * 1024


class ResponsesArgs(Settings):
    """The Responses API's stored objects (``store: true``, ``previous_response_id``), kept in the
    key registry's database with the keys and the ledger, so every router of every region sees
    the same rows (serve_app/router/response_store.py; docs/api.md, "Responses").

    Per owner, a quota its own puts keep: an owner past it loses its own oldest responses. The
    defaults fit a busy agent's month: 10,000 responses is 330 a day for the 30-day retention,
    and 256 MiB averages 26 KiB a row (a conversation at the 8192-token context is ~32 KiB of
    text, so a row at the cap is 40-70 KiB with its output). ``max_responses`` bounds the whole
    registry's table: past it, the owners holding the most lose their oldest first."""

    retention_hours: float = Field(720, gt=0, description="Stored responses expire after this (OpenAI keeps 30 days).")
    max_responses: int = Field(
        100_000, ge=1, description="Across every owner and region; past it the owners holding the most lose their oldest."
    )
    max_responses_per_owner: int = Field(10_000, ge=1, description="An owner past this loses its own oldest.")
    max_mib_per_owner: float = Field(
        256,
        ge=MAX_STORED_RESPONSE_BYTES / 2**20,  # one response must always fit
        description="Stored JSON (responses and their conversations) per owner; past it the owner loses its own oldest.",
    )

    @model_validator(mode="after")
    def _owner_within_total(self) -> "ResponsesArgs":
        if self.max_responses_per_owner > self.max_responses:
            raise ValueError(
                f"max_responses_per_owner ({self.max_responses_per_owner}) exceeds max_responses ({self.max_responses})"
            )
        return self


class UsageArgs(Settings):
    """The usage ledger's writer on each router replica (serve_app/usage/, docs/usage.md)."""

    spool_dir: str | None = Field(
        None,
        description="Where records wait while the registry database is unreachable (absolute path, "
        "on a volume every router replica of the region reaches); default: usage-spool/ beside the "
        "key store file (auth.key_store_path).",
    )
    flush_interval_s: float = Field(1.0, gt=0, le=60, description="Records are written in batches this often.")

    @field_validator("spool_dir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_absolute():
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class Peer(Settings):
    region: str = Field(description="The peer region's id.")
    endpoint: str = Field(description="Base URL of its router: https://..., or http:// on loopback.")

    @field_validator("endpoint")
    @classmethod
    def _https(cls, value: str) -> str:
        url = urlsplit(value)
        # Forwarded requests carry the caller's credential: plaintext only never leaves the host.
        if url.scheme == "https" or (url.scheme == "http" and url.hostname in _LOOPBACK_HOSTS):
            if url.hostname:
                return value.rstrip("/")
        raise ValueError(f"{value!r}: a peer endpoint must be https:// (http:// only on 127.0.0.1)")


class FailoverArgs(Settings):
    """Cross-region failover (serve_app/router/failover.py): one hop to a peer region's router."""

    peers: list[Peer] = Field(default_factory=list, description="Most preferred first.")
    max_attempts: int = Field(2, ge=1, description="Peers tried per request before giving up.")
    connect_timeout_s: float = Field(2, gt=0, description="Per peer: a dead peer costs this much.")
    unreachable_hold_s: float = Field(10, ge=0, description="Skip a peer this long after it was unreachable.")
    # Between bytes of the peer's answer; a non-streamed completion sends nothing until it is done.
    read_timeout_s: float = Field(600, gt=0)


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
