"""One model's deployment: its engine overrides, autoscaling, resources, routing and media
(``models[]`` of the app's args)."""

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app import catalog
from serve_app.config.media import MEDIA_FLAGS, MediaPolicy
from serve_app.settings import Settings

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
    # ...or, when set, one with this many requests ongoing: its engine's batch (max_num_seqs), so
    # the threshold does not move with max_ongoing_requests. Serve hashes these options into the
    # model's code version (a change replaces its replicas), and a region's max_ongoing_requests
    # is an in-place knob: the regions' render writes this, not a fraction of it.
    saturated_at: int | None = Field(None, ge=1)
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
            # Only the threshold in use: saturated_at when set, else saturated_fraction.
            "request_router_kwargs": routing.model_dump(
                exclude={"policy", "saturated_fraction" if routing.saturated_at is not None else "saturated_at"}
            ),
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

    @field_validator("env")
    @classmethod
    def _no_engine_limit_the_router_checks(cls, env: dict[str, str]) -> dict[str, str]:
        if "VLLM_MAX_STOP_STRINGS" in env:  # the router refuses a fifth stop sequence itself (router/strict.py)
            raise ValueError("VLLM_MAX_STOP_STRINGS cannot be set per replica: the router checks stop sequences "
                             "against vLLM's default, 4, before a request is charged")
        return env


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
    region_health: Literal["required", "optional"] = Field(
        "optional",
        description="required: the region's /health is 503 while this model serves on no replica, so "
        "global routing takes the region out of the global name (the region's main model); optional: "
        "the region stays in while another model serves, and this one's requests fail over to a peer "
        "one by one (docs/reliability.md, \"What /health says\").",
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
    def _required_is_loaded(self) -> "ModelDeploymentArgs":
        if self.region_health == "required" and self.initial_state == "cold":
            raise ValueError(
                "region_health: required with initial_state: cold would keep the region's /health 503 "
                "until an admin loads the model; make it optional, or start it loaded"
            )
        return self

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
