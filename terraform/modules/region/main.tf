# One edge region: its Blackwell GPU node pool (gpu_pool.tf), the KubeRay operator (kuberay.tf),
# the RayService that runs the rendered Serve config (rayservice.tf), its public ingress
# (ingress.tf), and here the namespace and the auth material every router reads.

locals {
  name = "serve-app"

  labels = {
    "app.kubernetes.io/name"       = local.name
    "app.kubernetes.io/part-of"    = "polargrid-edge"
    "app.kubernetes.io/managed-by" = "terraform"
    "polargrid.ai/region"          = var.region.id
  }
}

resource "kubernetes_namespace_v1" "serve" {
  metadata {
    name   = var.region.namespace
    labels = local.labels
  }
}

# The region's JWT signing keyset: its own private key(s) plus the public keys imported from the
# other regions, so their tokens verify here (docs/auth.md, "Across regions"). Mounted read-only
# (rayservice.tf); a `terraform apply` with a rotated keyset updates the mounted file in place and
# routers reload it without a restart.
resource "kubernetes_secret_v1" "signing_keys" {
  metadata {
    name      = "${local.name}-signing-keys"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  type = "Opaque"
  data = {
    (var.auth_mounts.signing_keys_file) = var.signing_keyset_json
  }
}

# The key registry's DSNs: API keys (hashes only), tiers, revocations, the usage ledger and
# budgets live in the one PostgreSQL registry every region shares (docs/auth.md, "Registry").
# `dsn` is its primary (every write), `read_dsn` the instance nearest this region (reads; empty:
# the primary). Routers read them from the env vars the Serve config names (rayservice.tf).
resource "kubernetes_secret_v1" "registry" {
  metadata {
    name      = "${local.name}-registry"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  type = "Opaque"
  data = {
    dsn      = var.registry_dsn
    read_dsn = var.registry_read_dsn
  }
}

# The CA bundle the registry's server certificates chain to (RDS's), which both DSNs name as
# sslrootcert (sslmode=verify-full). Public, hence a ConfigMap; mounted read-only (rayservice.tf).
resource "kubernetes_config_map_v1" "registry_ca" {
  metadata {
    name      = "${local.name}-registry-ca"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  data = {
    (var.auth_mounts.registry_ca_file) = var.registry_ca_bundle
  }
}

# The region's shared state: the usage ledger's spool (records waiting while the registry is
# unreachable), which any router pod replays. Keys and stored Responses live in the registry.
resource "kubernetes_persistent_volume_claim_v1" "state" {
  metadata {
    name      = "${local.name}-state"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  spec {
    access_modes       = ["ReadWriteMany"]
    storage_class_name = var.state_storage_class
    resources {
      requests = {
        storage = "1Gi"
      }
    }
  }

  wait_until_bound = false
}
