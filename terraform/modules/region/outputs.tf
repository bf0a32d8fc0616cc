output "public_endpoint" {
  description = "The region's public API base URL."
  value       = "https://${var.region.public_host}"
}

output "rayservice" {
  description = "Namespace and name of the RayService (kubectl -n NS get rayservice NAME)."
  value = {
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    name      = local.name
  }
}

output "gpu_nodes" {
  description = "The labelled and tainted Blackwell GPU nodes and their GPU counts."
  value       = var.region.gpu_nodes
}
