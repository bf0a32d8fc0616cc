"""The Serve-config half of ``serve-app regions render``: ``configs/<id>.yaml`` from a region file.

``serve_app.regions.render`` writes every generated file; this module builds the one a region's
Ray cluster deploys. Its ``args`` are validated through ``serve_app.config.AppArgs`` before they
are written, so a rendering that would not deploy cannot be written. Model facts (checkpoint,
FP8, context cap, eager mode, parsers, the speculative method) come from the catalog; a region
file sets only serving knobs, and opts a model into MTP speculative decoding.

Nothing here imports Ray or vLLM.
"""

import json
from typing import Any

import yaml
from pydantic import ValidationError

from serve_app import catalog
from serve_app.config import REQUEST_TIMEOUT_S, AppArgs
from serve_app.regions import layout
from serve_app.regions.schema import GLOBAL_HOSTNAME, Region, RegionError, RegionModel, public_endpoint
from serve_app.settings import describe_errors

RENDER_COMMAND = "serve-app regions render"
GENERATED_MARKER = "GENERATED from regions/"  # every generated text file carries it

# Where the region's auth material is mounted in the head pod, where the routers run alone
# (terraform/modules/region; ROUTER_NODE_RESOURCE below). The
# signing keyset comes from a Kubernetes Secret (read-only; a `terraform apply` with a rotated or
# re-imported keyset updates the mounted file in place and routers reload it). The API keys live
# in the registry every region shares (PostgreSQL): the region's registry Secret holds the DSN
# of its primary (REGISTRY_DSN_ENV, every write) and of the instance nearest the region
# (REGISTRY_READ_DSN_ENV, reads); both name the CA bundle mounted at REGISTRY_CA_DIR as their
# sslrootcert. The registry also holds the stored Responses; the writable shared volume holds only
# the usage ledger's spool (usage-spool/ beside key_store_path, which the registry replaces).
SIGNING_KEYS_DIR = "/etc/serve_app/signing"
SIGNING_KEYS_FILE = "signing-keys.json"
STATE_DIR = "/var/lib/serve_app"
KEY_STORE_FILE = "keys.sqlite3"
REGISTRY_DSN_ENV = "SERVE_APP_REGISTRY_DSN"
REGISTRY_READ_DSN_ENV = "SERVE_APP_REGISTRY_READ_DSN"
REGISTRY_CA_DIR = "/etc/serve_app/registry-ca"
REGISTRY_CA_FILE = "rds-ca.pem"
# The Ray resource only the region's head offers and every router replica asks for: the routers
# hold the registry's DSNs and the signing keys, so only the head pod gets them, and a model's GPU
# pod (whose engine fetches and decodes callers' media) holds none (docs/threat-model.md). The
# head offers a marker count, not a limit: its CPUs bound the routers (schema.Region checks them
# with a rolling update's replacements).
ROUTER_NODE_RESOURCE = "region_credentials"
HEAD_ROUTER_NODE_OFFER = 1000
# The same in every region, so a token minted in one region verifies in all of them.
TOKEN_ISSUER = "https://auth.edge.polargrid.ai"
TOKEN_AUDIENCE = f"https://{GLOBAL_HOSTNAME}"
TOKEN_TTL_S = 900


# --- the Serve config --------------------------------------------------------------------------


def auth_args(region: Region) -> dict[str, Any]:
    """The region's ``auth:`` block: key material at the paths the Terraform module mounts."""
    return {
        "key_store_path": f"{STATE_DIR}/{KEY_STORE_FILE}",  # the registry replaces it; the spool's dir
        "key_registry_dsn_env": REGISTRY_DSN_ENV,
        "key_registry_read_dsn_env": REGISTRY_READ_DSN_ENV,
        "signing_keys_path": f"{SIGNING_KEYS_DIR}/{SIGNING_KEYS_FILE}",
        "issuer": TOKEN_ISSUER,
        "audience": TOKEN_AUDIENCE,
        "token_ttl_s": TOKEN_TTL_S,
    }


def engine_args(model: RegionModel) -> dict[str, Any]:
    """The region's engine knobs; with ``speculative_decoding`` on, vLLM's ``--speculative-config``."""
    engine: dict[str, Any] = {
        "gpu_memory_utilization": model.gpu_memory_utilization,
        "max_num_seqs": model.max_num_seqs,
    }
    extra: dict[str, Any] = {}
    if model.max_num_batched_tokens is not None:
        extra["max-num-batched-tokens"] = model.max_num_batched_tokens
    if model.speculative_decoding is not None:
        config = catalog.speculative_config(
            catalog.get(model.id), model.speculative_decoding.num_speculative_tokens
        )
        extra["speculative-config"] = json.dumps(config)
    if extra:
        engine["extra_args"] = extra
    return engine


def model_args(region: Region, model: RegionModel) -> dict[str, Any]:
    """One model deployment: the catalog's checkpoint on one Blackwell GPU, or on its share of one
    (``gpu_memory.py``)."""
    autoscaling: dict[str, Any] = {"min_replicas": model.replicas.min}
    if model.replicas.initial is not None:
        autoscaling["initial_replicas"] = model.replicas.initial
    autoscaling |= {
        "max_replicas": model.replicas.max,
        "target_ongoing_requests": model.target_ongoing_requests,
        "upscale_delay_s": model.upscale_delay_s,
        "downscale_delay_s": model.downscale_delay_s,
    }
    state = {"initial_state": model.state} if model.state != "loaded" else {}
    # A replica takes affinity requests until its engine's batch is full (the rest wait in the
    # engine's queue): written as the batch itself, not as a share of max_ongoing_requests, which
    # would make that in-place knob a change of the routing options (Serve hashes those into the
    # code version: every replica of the model replaced, docs/operations.md).
    routing = {"routing": {"saturated_at": model.max_num_seqs}}
    health = {"region_health": model.region_health} if model.region_health != "optional" else {}
    # Off is the default: written only when the region allows some hosts.
    media = {"media": {"allowed_domains": list(region.media.allowed_domains)}} if region.media.enabled else {}
    return {
        "id": model.id,
        **state,
        **health,
        **media,
        # Only serving knobs: the checkpoint, quantization, context cap and eager mode stay the
        # catalog's (an override here would silently fork production settings per region).
        "engine": engine_args(model),
        "autoscaling": autoscaling,
        "max_ongoing_requests": model.max_ongoing_requests,
        "max_queued_requests": model.max_queued_requests,
        **routing,
        "resources": {
            "num_cpus": model.cpus,
            "num_gpus": model.gpus,
            "accelerator_type": region.gpu.accelerator_type,
        },
    }


_ARGS_ORDER = ("region", "router", "auth", "failover", "telemetry", "models")


def telemetry_args(region: Region) -> dict[str, Any]:
    """Tracing on, to the region's collector (docs/operations.md, "Where a region's traces go").
    http/protobuf wants the traces URL; grpc the collector's host:port as given."""
    endpoint = region.otlp_endpoint
    if region.otlp_protocol == "http/protobuf":
        endpoint += "/v1/traces"
    return {
        "tracing": {
            "enabled": True,
            "endpoint": endpoint,
            "protocol": region.otlp_protocol,
            "sampling_ratio": region.trace_sampling_ratio,
            "resource_attributes": {"deployment.environment": region.status},
        }
    }


def app_args(region: Region) -> dict[str, Any]:
    """The application's ``args``, validated by ``AppArgs`` and dumped back (explicit values only)."""
    raw = {
        "region": region.id,
        "router": {
            "num_replicas": region.router.replicas,
            "num_cpus": region.router.cpus,
            "resources": {ROUTER_NODE_RESOURCE: 1},
        },
        "auth": auth_args(region),
        # Peers' own routers, at their public endpoints, most preferred first (one hop).
        "failover": {"peers": [{"region": p, "endpoint": public_endpoint(p)} for p in region.peers]},
        "telemetry": telemetry_args(region),
        "models": [model_args(region, m) for m in region.models],
    }
    try:
        validated = AppArgs.model_validate(raw)
    except ValidationError as err:
        raise RegionError(
            "\n".join(f"regions/{region.id}.yaml renders invalid args: {p}" for p in describe_errors(err, "args"))
        ) from None
    dumped = layout.tidy(validated.model_dump(mode="json", exclude_unset=True))
    ordered = {key: dumped.pop(key) for key in _ARGS_ORDER if key in dumped}
    return ordered | dumped


def serve_config(region: Region) -> dict[str, Any]:
    """The whole Serve config for ``serve deploy`` (and the RayService's ``serveConfigV2``): the
    region's router and one application per model (``layout``: what each change restarts)."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": 8000, "request_timeout_s": REQUEST_TIMEOUT_S},
        "applications": layout.region_applications(app_args(region), name=layout.ROUTER_APP, route_prefix="/"),
    }


class _IndentedDumper(yaml.SafeDumper):
    """Indents list items under their key, as the hand-written configs do."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)


def _yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_IndentedDumper, sort_keys=False, default_flow_style=False, width=100)


def render_serve_config(region: Region) -> str:
    lines = [
        f"# {GENERATED_MARKER}{region.id}.yaml and serve_app/catalog.py by",
        f"# `{RENDER_COMMAND}`.",
        "# Do not edit by hand: edit the region file and re-render; CI fails on drift.",
        f"# {region.id}: {region.location} ({region.status}), {region.gpu.count} x {region.gpu.accelerator_type},",
        f"# {region.public_endpoint}. Catalog facts, not overridable per region:",
    ]
    for model in region.models:
        entry = catalog.get(model.id)
        lines.append(
            f"#   {entry.id}: {entry.hf_repo} ({entry.weights_precision} from the checkpoint),"
            f" max_model_len {entry.engine.max_model_len}, enforce_eager {str(entry.engine.enforce_eager).lower()}"
        )
    lines += [
        f"# auth: {SIGNING_KEYS_DIR} is the signing-keys Secret, {STATE_DIR} the key-store volume",
        "# (both mounted by terraform/modules/region). Deployed by Terraform as the RayService of",
        f"# terraform/regions/{region.id}; by hand: `serve deploy configs/{region.id}.yaml`.",
        LAYOUT_NOTE,
    ]
    return "\n".join(lines) + "\n" + _yaml(serve_config(region))


LAYOUT_NOTE = (
    "# The router's application and one per model: a change restarts only what it must\n"
    "# (serve_app/regions/layout.py; docs/operations.md, \"What a change restarts\")."
)
LOCAL_SOURCE = "regions/local/serve.yaml"  # the local region's settings, not a GPU region file
# Every local config and the file its settings come from: the embedded default (`make run`, the
# tests), the agent workload's two replicas with prefix caching on (`serve-app bench-agent`) and
# the benchmark's chat model alone (`make run SERVE_CONFIG=configs/local-bench.yaml`, `serve-app bench`).
LOCAL_SOURCES = {"configs/local.yaml": LOCAL_SOURCE, "configs/local-agent.yaml": "regions/local/agent.yaml",
                 "configs/local-bench.yaml": "regions/local/bench.yaml"}


def render_local_serve_config(source: str, source_path: str = LOCAL_SOURCE) -> str:
    """A local config (``LOCAL_SOURCES``) from its source: a Serve config whose one application
    holds the local region's settings as ``args`` (what ``make run`` and the tests deploy),
    expanded like a region's. The source's opening comment is kept; the rest of its comments stay
    there."""
    try:
        expanded = layout.expand(yaml.safe_load(source))
    except ValueError as err:
        raise RegionError(f"{source_path}: {err}") from None
    opening = []
    for line in source.splitlines():
        if not line.startswith("#"):
            break
        opening.append(line)
    lines = [
        f"# {GENERATED_MARKER}{source_path.removeprefix('regions/')} by `{RENDER_COMMAND}`.",
        f"# Do not edit by hand: edit {source_path} and re-render; CI fails on drift.",
        *opening,
        LAYOUT_NOTE,
    ]
    return "\n".join(lines) + "\n" + _yaml(expanded)
