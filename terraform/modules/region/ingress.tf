# The region's public endpoint (https://api.<id>.edge.polargrid.ai; GA regions also the global
# name) in front of the Serve service KubeRay creates for the RayService.
resource "kubernetes_ingress_v1" "public" {
  metadata {
    name      = local.name
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
    annotations = {
      "cert-manager.io/cluster-issuer" = var.cluster_issuer
      # Server-sent events go out as the engine produces them, not when a proxy buffer fills.
      "nginx.ingress.kubernetes.io/proxy-buffering" = "off"
      # The Serve config's http_options.request_timeout_s.
      "nginx.ingress.kubernetes.io/proxy-read-timeout" = "600"
      "nginx.ingress.kubernetes.io/proxy-send-timeout" = "600"
      # The router's own body limit (router/body.py, 2 MiB): past it the router answers 413 in
      # the route's error shape; under ingress-nginx's default (1m), a 1–2 MiB body got nginx's
      # HTML 413 and never reached a router.
      "nginx.ingress.kubernetes.io/proxy-body-size" = "2m"
    }
  }

  spec {
    ingress_class_name = var.ingress_class_name

    tls {
      hosts       = var.region.hostnames
      secret_name = "${local.name}-tls"
    }

    dynamic "rule" {
      for_each = var.region.hostnames
      content {
        host = rule.value
        http {
          path {
            path      = "/"
            path_type = "Prefix"
            backend {
              service {
                name = "${local.name}-serve-svc"
                port {
                  number = 8000
                }
              }
            }
          }
        }
      }
    }
  }

  depends_on = [kubernetes_manifest.rayservice]
}
