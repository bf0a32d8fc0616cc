# The KubeRay operator: reconciles the RayService (rayservice.tf) into a Ray cluster, deploys the
# Serve config on it and upgrades it without downtime.
resource "helm_release" "kuberay_operator" {
  name             = "kuberay-operator"
  repository       = "https://ray-project.github.io/kuberay-helm/"
  chart            = "kuberay-operator"
  version          = var.kuberay_chart_version
  namespace        = "kuberay-system"
  create_namespace = true
  atomic           = true
  wait             = true
}
