# The Blackwell GPU node pool. Edge regions are PolarGrid's own servers in a colocation site,
# joined to the region's Kubernetes cluster (see docs/regions.md, "Why no cloud node pool"), so
# the pool is the region file's list of GPU nodes: Terraform labels them, so the Ray GPU workers
# select them, and taints them, so nothing else lands on a GPU.

locals {
  gpu_pool_labels = {
    "polargrid.ai/gpu-pool"    = "blackwell"
    "polargrid.ai/accelerator" = var.region.accelerator_type
  }

  # The taint the NVIDIA device plugin and GPU operator already tolerate.
  gpu_taint = {
    key    = "nvidia.com/gpu"
    value  = "present"
    effect = "NoSchedule"
  }
}

resource "kubernetes_labels" "gpu_node" {
  for_each = var.region.gpu_nodes

  api_version = "v1"
  kind        = "Node"
  metadata {
    name = each.key
  }
  labels = merge(local.gpu_pool_labels, {
    "polargrid.ai/region"    = var.region.id
    "polargrid.ai/gpu-count" = tostring(each.value)
  })
  field_manager = "terraform-serve-app"
}

resource "kubernetes_node_taint" "gpu_node" {
  for_each = var.region.gpu_nodes

  metadata {
    name = each.key
  }
  taint {
    key    = local.gpu_taint.key
    value  = local.gpu_taint.value
    effect = local.gpu_taint.effect
  }
  field_manager = "terraform-serve-app"
}
