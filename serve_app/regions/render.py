"""Render the files generated from ``regions/`` (``serve-app regions render``).

Every region file (``serve_app.regions.schema``) plus the catalog becomes:

- ``configs/<id>.yaml``: the Serve config (``serve deploy``; Terraform embeds the same file in
  the region's RayService), built by ``serve_app.regions.serve_config``; and ``configs/local.yaml``
  (``make run``, the tests) from ``regions/local/serve.yaml``, laid out the same way
  (``serve_app.regions.layout``);
- ``terraform/regions/<id>/main.tf`` and ``generated.auto.tfvars.json``: the region's Terraform
  root and its variables (here);
- ``terraform/global/generated.auto.tfvars.json``: every region's endpoint for the global
  latency-routed DNS name and its health checks (here);
- ``terraform/global/registry_replicas.tf``: a read replica of the key registry in each distinct
  AWS region the regions are nearest (their ``route53_latency_region``), with its provider alias
  (here: Terraform cannot iterate over providers).

Everything generated is deterministic; ``serve-app regions check`` (and the unit tests) fail when a
committed file differs from its rendering.

Nothing here imports Ray or vLLM.
"""

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from serve_app.paths import REPO_ROOT
from serve_app.regions.serve_config import (
    GENERATED_MARKER,
    HEAD_ROUTER_NODE_OFFER,
    REGISTRY_CA_DIR,
    REGISTRY_CA_FILE,
    REGISTRY_DSN_ENV,
    REGISTRY_READ_DSN_ENV,
    RENDER_COMMAND,
    ROUTER_NODE_RESOURCE,
    SIGNING_KEYS_DIR,
    SIGNING_KEYS_FILE,
    STATE_DIR,
    LOCAL_SOURCES,
    render_local_serve_config,
    render_serve_config,
)
from serve_app.regions.schema import DNS_ZONE, GLOBAL_HOSTNAME, Region, RegionError


# --- Terraform ---------------------------------------------------------------------------------


def ray_version() -> str:
    """The Ray version pinned in pyproject.toml: the RayService's `rayVersion` must match the image."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["serve"]:  # the service's extra
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
            # ingress and its certificate must cover it. A draining one too: resolvers hold its
            # answer for the record's TTL, and a drain must not change the region's own resources.
            "hostnames": [region.public_host] + ([GLOBAL_HOSTNAME] if region.status == "ga" else []),
            "namespace": k8s.namespace,
            "accelerator_type": region.gpu.accelerator_type,
            "gpu_nodes": {node.name: node.gpus for node in region.gpu.nodes},
            # One worker pod per GPU: as many as the models' replica bounds take of GPUs (a
            # model sharing each GPU takes its fraction of one per replica).
            "gpu_workers": {
                "min": gpus_taken(region, "min"),
                "max": gpus_taken(region, "max"),
            },
            # The head offers the resource the routers ask for: they run there alone, with the
            # credentials only its pod gets (terraform/modules/region/rayservice.tf).
            "head": {
                "cpus": k8s.head.cpus,
                "memory_gib": k8s.head.memory_gib,
                "resources": {ROUTER_NODE_RESOURCE: HEAD_ROUTER_NODE_OFFER},
            },
            "gpu_worker": {"cpus": k8s.gpu_worker.cpus, "memory_gib": k8s.gpu_worker.memory_gib},
            "otlp_endpoint": region.otlp_endpoint,
            # "" and "": the GCS in the head's memory (no fault tolerance).
            "gcs_redis": k8s.gcs_redis.model_dump() if k8s.gcs_redis else {"address": "", "password_secret": ""},
        },
        "ray_version": ray_version(),
        "auth_mounts": {
            "signing_keys_dir": SIGNING_KEYS_DIR,
            "signing_keys_file": SIGNING_KEYS_FILE,
            "state_dir": STATE_DIR,
            "registry_ca_dir": REGISTRY_CA_DIR,
            "registry_ca_file": REGISTRY_CA_FILE,
        },
        "registry_read_dsn_env": REGISTRY_READ_DSN_ENV,
        "stream_tls_secret": region.stream_tls_secret or "",  # "": plaintext
    }


def gpus_taken(region: Region, bound: str) -> int:
    """Whole GPUs the models' ``min`` or ``max`` replicas take: fractions of one add up."""
    return math.ceil(round(sum(getattr(m.replicas, bound) * m.gpus for m in region.models), 6))


def terraform_global_vars(regions: dict[str, Region]) -> dict[str, Any]:
    """``terraform/global/generated.auto.tfvars.json``: endpoints for DNS and health checks."""
    return {
        "dns_zone": DNS_ZONE,
        "global_hostname": GLOBAL_HOSTNAME,
        "regions": {
            region.id: {
                "location": region.location,
                "status": region.status,
                "behind_global_name": region.behind_global_name,
                "endpoint_host": region.public_host,
                "route53_latency_region": region.route53_latency_region,
            }
            for region in regions.values()
        },
    }


_REGION_ROOT_TF = """\
# @MARKER@@ID@.yaml by `@COMMAND@`.
# Do not edit by hand: the template is serve_app/regions/render.py (_REGION_ROOT_TF); CI fails on drift.
#
# Terraform root of region @ID@: state, providers and terraform/modules/region, fed by
# generated.auto.tfvars.json (same region file) and the rendered Serve config configs/@ID@.yaml.
# Secrets and the release come from the environment, never from files in git:
#   TF_VAR_cluster_host, TF_VAR_cluster_ca_certificate, TF_VAR_cluster_token,
#   TF_VAR_image, TF_VAR_signing_keyset_json, TF_VAR_registry_dsn, TF_VAR_registry_read_dsn,
#   TF_VAR_registry_ca_bundle
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
    head             = object({ cpus = number, memory_gib = number, resources = map(number) })
    gpu_worker       = object({ cpus = number, memory_gib = number })
    otlp_endpoint    = string
    gcs_redis        = object({ address = string, password_secret = string })
  })
}

variable "ray_version" {
  description = "Ray version of the image (generated from pyproject.toml)."
  type        = string
}

variable "auth_mounts" {
  description = "Where the auth config expects its files (generated from serve_app/regions/render.py)."
  type = object({
    signing_keys_dir  = string
    signing_keys_file = string
    state_dir         = string
    registry_ca_dir   = string
    registry_ca_file  = string
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

variable "registry_dsn" {
  description = "postgresql:// DSN of the key registry's primary, which every region shares (docs/auth.md, section Registry)."
  type        = string
  sensitive   = true
}

variable "registry_read_dsn" {
  description = "postgresql:// DSN of the registry instance nearest this region, for reads (terraform/global output registry_read_endpoints)."
  type        = string
  sensitive   = true
}

variable "registry_read_dsn_env" {
  description = "The env var the routers read the read DSN from (generated from serve_app/regions/serve_config.py)."
  type        = string
}

variable "registry_ca_bundle" {
  description = "PEM CA bundle of the registry's server certificates (RDS), the DSNs' sslrootcert."
  type        = string
}

variable "stream_tls_secret" {
  description = "Secret with the byte socket's TLS files; empty: plaintext (generated from regions/@ID@.yaml)."
  type        = string
  default     = ""
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

  region                = var.region
  ray_version           = var.ray_version
  auth_mounts           = var.auth_mounts
  image                 = var.image
  serve_config          = file("${path.module}/../../../configs/@ID@.yaml")
  signing_keyset_json   = var.signing_keyset_json
  registry_dsn          = var.registry_dsn
  registry_dsn_env      = "@REGISTRY_DSN_ENV@"
  registry_read_dsn     = var.registry_read_dsn
  registry_read_dsn_env = var.registry_read_dsn_env
  registry_ca_bundle    = var.registry_ca_bundle
  stream_tls_secret     = var.stream_tls_secret
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
        .replace("@REGISTRY_DSN_ENV@", REGISTRY_DSN_ENV)
    )


# --- the key registry's read replicas (terraform/global/registry_replicas.tf) --------------------


def registry_replica_regions(regions: dict[str, Region]) -> dict[str, list[str]]:
    """Each distinct AWS region an edge region is nearest (its ``route53_latency_region``), with
    the edge regions nearest it, sorted: one read replica each (none, at plan time, in the
    primary's own region)."""
    nearest: dict[str, list[str]] = {}
    for region in regions.values():
        nearest.setdefault(region.route53_latency_region, []).append(region.id)
    return {aws: sorted(ids) for aws, ids in sorted(nearest.items())}


def tf_name(aws_region: str) -> str:
    """``us-west-2`` -> ``us_west_2``: the provider alias and module name of that region's replica."""
    return aws_region.replace("-", "_")


_REGISTRY_REPLICAS_HEADER = """\
# @MARKER@*.yaml by `@COMMAND@`.
# Do not edit by hand: the template is serve_app/regions/render.py (_REGISTRY_REPLICA_TF); CI fails on drift.
#
# The key registry's read replicas (registry.tf): one in each distinct AWS region the region
# files name as route53_latency_region, with the edge regions nearest it:
@NEAREST@
# The one in var.registry_primary_region creates nothing: the edge regions nearest it read the
# primary.
# Terraform cannot iterate over providers, hence an alias of the aws provider main.tf pins and a
# module call per AWS region.
"""

_REGISTRY_REPLICA_TF = """
provider "aws" {
  alias  = "@ALIAS@"
  region = "@AWS@"
}

module "registry_replica_@ALIAS@" {
  source    = "../modules/registry_replica"
  providers = { aws = aws.@ALIAS@ }

  enabled                   = var.registry_primary_region != "@AWS@"
  identifier                = "${local.registry_identifier}-@AWS@"
  source_db_arn             = aws_db_instance.registry.arn
  engine_version            = local.registry_engine_version.replicas
  instance_class            = var.registry_instance_class
  max_allocated_storage_gib = var.registry_storage_gib.max
  network                   = try(var.registry_network["@AWS@"], null)
  monitoring_role_arn       = aws_iam_role.registry_monitoring.arn
  log_retention_days        = var.registry_log_retention_days
  tags                      = local.registry_tags
}
"""


def render_registry_replicas(regions: dict[str, Region]) -> str:
    nearest = registry_replica_regions(regions)
    text = (
        _REGISTRY_REPLICAS_HEADER.replace("@MARKER@", GENERATED_MARKER)
        .replace("@COMMAND@", RENDER_COMMAND)
        .replace("@NEAREST@", "\n".join(f"#   {aws}: {', '.join(ids)}" for aws, ids in nearest.items()))
    )
    for aws in nearest:
        text += _REGISTRY_REPLICA_TF.replace("@ALIAS@", tf_name(aws)).replace("@AWS@", aws)
    width = max(len(aws) for aws in nearest) + 2  # `terraform fmt` aligns the map's `=`
    endpoints = "".join(
        f'    {f"{chr(34)}{aws}{chr(34)}":<{width}} = module.registry_replica_{tf_name(aws)}.endpoint\n'
        for aws in nearest
    )
    return text + (
        "\nlocals {\n"
        "  # host:port of the replica in each AWS region (null in the primary's): outputs.tf.\n"
        "  registry_replica_endpoints = {\n" + endpoints + "  }\n}\n"
    )


def _json(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def rendered_files(regions: dict[str, Region], repo: Path = REPO_ROOT) -> dict[str, str]:
    """Every generated file, by path relative to the repository, in a stable order."""
    files: dict[str, str] = {
        config: render_local_serve_config((repo / source).read_text(), source) for config, source in LOCAL_SOURCES.items()
    }
    for region in regions.values():
        files[f"configs/{region.id}.yaml"] = render_serve_config(region)
        files[f"terraform/regions/{region.id}/main.tf"] = render_region_root(region)
        files[f"terraform/regions/{region.id}/generated.auto.tfvars.json"] = _json(
            terraform_region_vars(region)
        )
    files["terraform/global/generated.auto.tfvars.json"] = _json(terraform_global_vars(regions))
    files["terraform/global/registry_replicas.tf"] = render_registry_replicas(regions)
    return files


def generated_files_on_disk(repo: Path) -> set[str]:
    """Files a rendering wrote before (so a removed region's leftovers are found)."""
    found = set()
    for path in (repo / "configs").glob("*.yaml"):
        if GENERATED_MARKER in path.read_text().split("\n", 1)[0]:
            found.add(str(path.relative_to(repo)))
    for path in [*(repo / "terraform" / "regions").glob("*/main.tf"), *(repo / "terraform" / "global").glob("*.tf")]:
        if GENERATED_MARKER in path.read_text().split("\n", 1)[0]:
            found.add(str(path.relative_to(repo)))
    for path in (repo / "terraform").glob("**/generated.auto.tfvars.json"):
        if ".terraform" not in path.parts:
            found.add(str(path.relative_to(repo)))
    return found
