# Voluntary disruptions (a node drain, a cluster upgrade) must not take the region down by
# surprise. The head pod holds the GCS and the Serve controller; without GCS fault tolerance (a
# region's kubernetes.gcs_redis, rayservice.tf) losing it restarts every Ray pod of the region,
# engines included (minutes of 503s), and with it the routers placed on the head still restart.
# So its eviction is refused; a drain of its node waits until an SRE has taken the region
# out of traffic and lets it go (docs/operations.md, "Node maintenance"). The GPU workers go one
# at a time. KubeRay deletes pods itself in a rollout or a scale-down: a budget binds evictions
# only, so neither is held back.

resource "kubernetes_pod_disruption_budget_v1" "head" {
  metadata {
    name      = "${local.name}-head"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  spec {
    max_unavailable = "0"
    selector {
      match_labels = {
        "app.kubernetes.io/name" = local.name
        "ray.io/node-type"       = "head" # KubeRay's label on every RayCluster's head pod
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "gpu_workers" {
  metadata {
    name      = "${local.name}-gpu-workers"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  spec {
    max_unavailable = "1"
    selector {
      match_labels = {
        "app.kubernetes.io/name" = local.name
        "ray.io/group"           = local.gpu_worker_group
      }
    }
  }
}
