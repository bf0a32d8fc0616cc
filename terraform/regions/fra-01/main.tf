# GENERATED from regions/fra-01.yaml by `serve-app regions render`.
# Do not edit by hand: the template is serve_app/regions/render.py (_REGION_ROOT_TF); CI fails on drift.
#
# Terraform root of region fra-01: state, providers and terraform/modules/region, fed by
# generated.auto.tfvars.json (same region file) and the rendered Serve config configs/fra-01.yaml.
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
    key = "serve-app/regions/fra-01.tfstate"
  }
}

variable "region" {
  description = "The region's facts (generated from regions/fra-01.yaml)."
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
  description = "Secret with the byte socket's TLS files; empty: plaintext (generated from regions/fra-01.yaml)."
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
  serve_config          = file("${path.module}/../../../configs/fra-01.yaml")
  signing_keyset_json   = var.signing_keyset_json
  registry_dsn          = var.registry_dsn
  registry_dsn_env      = "SERVE_APP_REGISTRY_DSN"
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
