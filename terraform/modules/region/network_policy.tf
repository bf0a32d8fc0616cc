# Only the region's Ray pods reach the model replicas' stream listeners (the plaintext byte path
# from a model replica to a router, serve_app/wire/socket.py; docs/threat-model.md, "The stream
# listener"). The routers, the listeners' only callers, run on the head alone (they ask for the
# resource only it offers, rayservice.tf), but a cluster started before that placed some on GPU
# workers' spare CPUs, and it keeps serving through the rollout that replaces it: admitting the
# head alone would cut its routers' streams then. Narrowing the source to the head pods is a
# second apply, once no region runs such a cluster.
#
# A pod any NetworkPolicy selects is closed to all ingress no policy allows, so the second rule
# keeps every other port of the GPU workers as open as before (Ray's GCS, raylet, object manager
# and worker ports, each Serve replica's inter-deployment gRPC port, which the routers call
# (router.handle_transport), the dashboard agent, HAProxy, Prometheus's scrape): this policy narrows the
# stream ports and nothing else. Needs a CNI that enforces NetworkPolicy with endPort (Calico,
# Cilium; Kubernetes >= 1.25); traffic from the node itself (kubelet, hostNetwork pods) is always
# allowed by Kubernetes' rules.

locals {
  # Every Ray pod of this region's RayService: KubeRay labels its pods ray.io/is-ray-node=yes and
  # keeps the template's labels (rayservice.tf), which no other pod in the namespace carries.
  ray_pods = {
    "app.kubernetes.io/name" = local.name
    "ray.io/is-ray-node"     = "yes"
  }
}

resource "kubernetes_network_policy_v1" "stream_listener" {
  metadata {
    name      = "${local.name}-stream-listener"
    namespace = kubernetes_namespace_v1.serve.metadata[0].name
    labels    = local.labels
  }

  spec {
    # The model pods: the GPU worker group, where every model replica and its listener runs.
    pod_selector {
      match_labels = {
        "app.kubernetes.io/name" = local.name
        "ray.io/group"           = local.gpu_worker_group
      }
    }
    policy_types = ["Ingress"]

    # The listeners' ports (SERVE_APP_STREAM_PORTS, rayservice.tf): the region's Ray pods only.
    ingress {
      from {
        pod_selector {
          match_labels = local.ray_pods
        }
      }
      ports {
        protocol = "TCP"
        port     = tostring(var.stream_listener_ports.first)
        end_port = var.stream_listener_ports.last
      }
    }

    # Every other port, from anywhere, as before this policy.
    ingress {
      ports {
        protocol = "TCP"
        port     = "1"
        end_port = var.stream_listener_ports.first - 1
      }
      ports {
        protocol = "TCP"
        port     = tostring(var.stream_listener_ports.last + 1)
        end_port = 65535
      }
      ports {
        protocol = "UDP"
        port     = "1"
        end_port = 65535
      }
    }
  }
}
