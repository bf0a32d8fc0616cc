"""Render the files generated from ``regions/`` (``serve-app regions render``).

Every region file (``serve_app.regions``) plus the catalog becomes:

- ``configs/<id>.yaml``: the Serve config (``serve deploy``; Terraform embeds the same file in
  the region's RayService);
- ``terraform/regions/<id>/main.tf`` and ``generated.auto.tfvars.json``: the region's Terraform
  root and its variables;
- ``terraform/global/generated.auto.tfvars.json``: every region's endpoint for the global
  latency-routed DNS name and its health checks.

Everything generated is deterministic; ``regions_cli check`` (and the unit tests) fail when a
committed file differs from its rendering. The Serve config is built by validating through
``serve_app.config.AppArgs``, so a rendering that would not deploy cannot be written.

Nothing here imports Ray or vLLM.
"""

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from serve_app import catalog
from serve_app.config import AppArgs
from serve_app.paths import REPO_ROOT
from serve_app.regions import (
    DNS_ZONE,
    GLOBAL_HOSTNAME,
    Region,
    RegionError,
    RegionModel,
    problems,
    public_endpoint,
)

RENDER_COMMAND = "serve-app regions render"
GENERATED_MARKER = "GENERATED from regions/"  # every generated text file carries it

# Where the region's auth material is mounted in every Ray pod (terraform/modules/region). The
# signing keyset comes from a Kubernetes Secret (read-only; a `terraform apply` with a rotated or
# re-imported keyset updates the mounted file in place and routers reload it); the API-key store
# needs a writable shared volume (the admin API revokes keys).
SIGNING_KEYS_DIR = "/etc/serve_app/signing"
SIGNING_KEYS_FILE = "signing-keys.json"
STATE_DIR = "/var/lib/serve_app"
KEY_STORE_FILE = "keys.sqlite3"
# The same in every region, so a token minted in one region verifies in all of them.
TOKEN_ISSUER = "https://auth.edge.polargrid.ai"
TOKEN_AUDIENCE = f"https://{GLOBAL_HOSTNAME}"
TOKEN_TTL_S = 900


# --- the Serve config --------------------------------------------------------------------------


def _tidy(value: Any) -> Any:
    """Whole floats as ints (24.0 -> 24) so the YAML reads as written; everything else as is."""
    if isinstance(value, dict):
        return {k: _tidy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_tidy(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def auth_args(region: Region) -> dict[str, Any]:
    """The region's ``auth:`` block: key material at the paths the Terraform module mounts."""
    return {
        "key_store_path": f"{STATE_DIR}/{KEY_STORE_FILE}",
        "signing_keys_path": f"{SIGNING_KEYS_DIR}/{SIGNING_KEYS_FILE}",
        "issuer": TOKEN_ISSUER,
        "audience": TOKEN_AUDIENCE,
        "token_ttl_s": TOKEN_TTL_S,
    }


def model_args(region: Region, model: RegionModel) -> dict[str, Any]:
    """One model deployment: the catalog's checkpoint (FP8, 8192 cap, eager) on one Blackwell GPU."""
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
    return {
        "id": model.id,
        **state,
        # Only serving knobs: the checkpoint, quantization, context cap and eager mode stay the
        # catalog's (an override here would silently fork production settings per region).
        "engine": {
            "gpu_memory_utilization": model.gpu_memory_utilization,
            "max_num_seqs": model.max_num_seqs,
        },
        "autoscaling": autoscaling,
        "max_ongoing_requests": model.max_ongoing_requests,
        "max_queued_requests": model.max_queued_requests,
        "resources": {
            "num_cpus": model.cpus,
            "num_gpus": 1,
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
        "router": {"num_replicas": region.router.replicas, "num_cpus": region.router.cpus},
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
            "\n".join(f"regions/{region.id}.yaml renders invalid args: {p}" for p in problems(err))
        ) from None
    dumped = _tidy(validated.model_dump(mode="json", exclude_unset=True))
    ordered = {key: dumped.pop(key) for key in _ARGS_ORDER if key in dumped}
    return ordered | dumped


def serve_config(region: Region) -> dict[str, Any]:
    """The whole Serve config for ``serve deploy`` (and the RayService's ``serveConfigV2``)."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 600},
        "applications": [
            {
                "name": "llm",
                "route_prefix": "/",
                "import_path": "serve_app.app:build_app",
                "args": app_args(region),
            }
        ],
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
    ]
    return "\n".join(lines) + "\n" + _yaml(serve_config(region))


# --- Terraform ---------------------------------------------------------------------------------


def ray_version() -> str:
    """The Ray version pinned in pyproject.toml: the RayService's `rayVersion` must match the image."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        match = re.match(r"^ray(\[[^\]]*\])?==(\S+)$", requirement.replace(" ", ""))
        if match:
            return match.group(2)
    raise RegionError("pyproject.toml does not pin ray (ray[serve]==X.Y.Z)")


def terraform_region_vars(region: Region) -> dict[str, Any]:
    """``terraform/regions/<id>/generated.auto.tfvars.json``: the region module's inputs."""
    k8s = region.kubernetes
    return {
        "region": {
            "id": region.id,
            "location": region.location,
            "status": region.status,
            "public_host": region.public_host,
            # GA regions also answer for the global name: its latency records point here, so the
            # ingress and its certificate must cover it.
            "hostnames": [region.public_host] + ([GLOBAL_HOSTNAME] if region.status == "ga" else []),
            "namespace": k8s.namespace,
            "accelerator_type": region.gpu.accelerator_type,
            "gpu_nodes": {node.name: node.gpus for node in region.gpu.nodes},
            # One worker pod per GPU: as many as the models' replica bounds add up to.
            "gpu_workers": {
                "min": sum(m.replicas.min for m in region.models),
                "max": sum(m.replicas.max for m in region.models),
            },
            "head": {"cpus": k8s.head.cpus, "memory_gib": k8s.head.memory_gib},
            "gpu_worker": {"cpus": k8s.gpu_worker.cpus, "memory_gib": k8s.gpu_worker.memory_gib},
            "otlp_endpoint": region.otlp_endpoint,
        },
        "ray_version": ray_version(),
        "auth_mounts": {
            "signing_keys_dir": SIGNING_KEYS_DIR,
            "signing_keys_file": SIGNING_KEYS_FILE,
            "state_dir": STATE_DIR,
        },
    }


def terraform_global_vars(regions: dict[str, Region]) -> dict[str, Any]:
    """``terraform/global/generated.auto.tfvars.json``: endpoints for DNS and health checks."""
    return {
        "dns_zone": DNS_ZONE,
        "global_hostname": GLOBAL_HOSTNAME,
        "regions": {
            region.id: {
                "location": region.location,
                "status": region.status,
                "endpoint_host": region.public_host,
                "route53_latency_region": region.route53_latency_region,
            }
            for region in regions.values()
        },
    }


_REGION_ROOT_TF = """\
# @MARKER@@ID@.yaml by `@COMMAND@`.
# Do not edit by hand: the template is serve_app/region_render.py (_REGION_ROOT_TF); CI fails on drift.
#
# Terraform root of region @ID@: state, providers and terraform/modules/region, fed by
# generated.auto.tfvars.json (same region file) and the rendered Serve config configs/@ID@.yaml.
# Secrets and the release come from the environment, never from files in git:
#   TF_VAR_cluster_host, TF_VAR_cluster_ca_certificate, TF_VAR_cluster_token,
#   TF_VAR_image, TF_VAR_signing_keyset_json
# See docs/regions.md ("Terraform") for init and the first apply.

terraform {
  required_version = ">= 1.10.0"

  required_providers {
    helm = {
      source  = "hashicorp/helm"
      version = "2.17.0"
    }
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "2.38.0"
    }
  }

  # Partial configuration: bucket, region and locking come from
  # `terraform init -backend-config=../../backend.hcl`.
  backend "s3" {
    key = "serve-app/regions/@ID@.tfstate"
  }
}

variable "region" {
  description = "The region's facts (generated from regions/@ID@.yaml)."
  type = object({
    id               = string
    location         = string
    status           = string
    public_host      = string
    hostnames        = list(string)
    namespace        = string
    accelerator_type = string
    gpu_nodes        = map(number)
    gpu_workers      = object({ min = number, max = number })
    head             = object({ cpus = number, memory_gib = number })
    gpu_worker       = object({ cpus = number, memory_gib = number })
    otlp_endpoint    = string
  })
}

variable "ray_version" {
  description = "Ray version of the image (generated from pyproject.toml)."
  type        = string
}

variable "auth_mounts" {
  description = "Where the auth config expects its files (generated from serve_app/region_render.py)."
  type = object({
    signing_keys_dir  = string
    signing_keys_file = string
    state_dir         = string
  })
}

variable "cluster_host" {
  description = "API server URL of the region's Kubernetes cluster."
  type        = string
}

variable "cluster_ca_certificate" {
  description = "PEM CA certificate of the cluster's API server."
  type        = string
}

variable "cluster_token" {
  description = "Token of the deploying service account."
  type        = string
  sensitive   = true
}

variable "image" {
  description = "serve_app image with the GPU build of vLLM, pinned by digest (repo@sha256:...)."
  type        = string
}

variable "signing_keyset_json" {
  description = "This region's JWT signing keyset JSON (own private keys, peers' public keys)."
  type        = string
  sensitive   = true
}

provider "kubernetes" {
  host                   = var.cluster_host
  cluster_ca_certificate = var.cluster_ca_certificate
  token                  = var.cluster_token
}

provider "helm" {
  kubernetes {
    host                   = var.cluster_host
    cluster_ca_certificate = var.cluster_ca_certificate
    token                  = var.cluster_token
  }
}

module "region" {
  source = "../../modules/region"

  region              = var.region
  ray_version         = var.ray_version
  auth_mounts         = var.auth_mounts
  image               = var.image
  serve_config        = file("${path.module}/../../../configs/@ID@.yaml")
  signing_keyset_json = var.signing_keyset_json
}

output "public_endpoint" {
  value = module.region.public_endpoint
}

output "rayservice" {
  value = module.region.rayservice
}
"""


def render_region_root(region: Region) -> str:
    return (
        _REGION_ROOT_TF.replace("@MARKER@", GENERATED_MARKER)
        .replace("@COMMAND@", RENDER_COMMAND)
        .replace("@ID@", region.id)
    )


def _json(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def rendered_files(regions: dict[str, Region]) -> dict[str, str]:
    """Every generated file, by path relative to the repository, in a stable order."""
    files: dict[str, str] = {}
    for region in regions.values():
        files[f"configs/{region.id}.yaml"] = render_serve_config(region)
        files[f"terraform/regions/{region.id}/main.tf"] = render_region_root(region)
        files[f"terraform/regions/{region.id}/generated.auto.tfvars.json"] = _json(
            terraform_region_vars(region)
        )
    files["terraform/global/generated.auto.tfvars.json"] = _json(terraform_global_vars(regions))
    return files


def generated_files_on_disk(repo: Path) -> set[str]:
    """Files a rendering wrote before (so a removed region's leftovers are found)."""
    found = set()
    for path in (repo / "configs").glob("*.yaml"):
        if GENERATED_MARKER in path.read_text().split("\n", 1)[0]:
            found.add(str(path.relative_to(repo)))
    for path in (repo / "terraform" / "regions").glob("*/main.tf"):
        if GENERATED_MARKER in path.read_text().split("\n", 1)[0]:
            found.add(str(path.relative_to(repo)))
    for path in (repo / "terraform").glob("**/generated.auto.tfvars.json"):
        if ".terraform" not in path.parts:
            found.add(str(path.relative_to(repo)))
    return found
