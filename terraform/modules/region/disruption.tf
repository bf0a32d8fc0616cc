# Voluntary disruptions (a node drain, a cluster upgrade) must not take the region down by
# surprise. The head pod holds the GCS and the Serve controller; without GCS fault tolerance (a
# region's kubernetes.gcs_redis, rayservice.tf) losing it restarts every Ray pod of the region,
# engines included (minutes of 503s), and with it the routers (which run on the head) still restart.
# So its eviction is refused; a drain of its node waits until an SRE has taken the region out of
# traffic and moved it (docs/operations.md, "Node maintenance"). GPU workers may be evicted
# while the region keeps its floor less one (gpu_workers.min - 1: at the floor one goes, the next
# waits for its replacement). KubeRay deletes pods itself in a rollout or a scale-down: a budget
# binds evictions only, so neither is held back.
#
# minAvailable, an integer: the pods' owner is a RayCluster, a custom resource without the scale
# subresource, for which Kubernetes' disruption controller cannot apply maxUnavailable (it fails
# to sync and allows no eviction at all; the Kubernetes docs' rule for operator-run pods).

resource "kubernetes_pod_disruption_budget_v1" "head" {
  metadata {
    name      = "${local.name}-head"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  spec {
    min_available = "1" # the only head: no eviction (two during a rollout: one of them)
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
    min_available = tostring(max(var.region.gpu_workers.min - 1, 0))
    selector {
      match_labels = {
        "app.kubernetes.io/name" = local.name
        "ray.io/group"           = local.gpu_worker_group
      }
    }
  }
}
