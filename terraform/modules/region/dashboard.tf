# The region's Grafana dashboard (dashboards/serve_app.json: serve_app's metrics and Ray Serve's)
# as a ConfigMap labelled grafana_dashboard=1, the label Grafana's dashboard sidecar (grafana and
# kube-prometheus-stack Helm charts, sidecar.dashboards) loads from the namespaces it searches.
resource "kubernetes_config_map_v1" "grafana_dashboard" {
  metadata {
    name      = "${local.name}-grafana-dashboard"
    namespace = coalesce(var.grafana_dashboard_namespace, kubernetes_namespace_v1.serve.metadata[0].name)
    labels    = merge(local.labels, { grafana_dashboard = "1" })
  }

  data = {
    "serve_app.json" = file("${path.module}/dashboards/serve_app.json")
  }
}
