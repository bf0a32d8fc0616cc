variable "region" {
  description = "The region's facts, generated from regions/<id>.yaml by serve_app.regions."
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

  validation {
    condition     = contains(["RTX-PRO-6000", "B200"], var.region.accelerator_type)
    error_message = "accelerator_type must be a Blackwell Ray accelerator type: RTX-PRO-6000 or B200."
  }
}

variable "ray_version" {
  description = "Ray version inside var.image (KubeRay's rayVersion)."
  type        = string
}

variable "auth_mounts" {
  description = "Mount points the region's auth config names (serve_app/regions/render.py)."
  type = object({
    signing_keys_dir  = string
    signing_keys_file = string
    state_dir         = string
    registry_ca_dir   = string
    registry_ca_file  = string
  })
}

variable "image" {
  description = "serve_app image with the GPU build of vLLM, pinned by digest (repo@sha256:...)."
  type        = string

  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.image))
    error_message = "Pin the image by digest (repo@sha256:<64 hex>): a tag can move under a running region."
  }
}

variable "serve_config" {
  description = "The rendered Serve config (configs/<id>.yaml), embedded as the RayService's serveConfigV2."
  type        = string
}

variable "signing_keyset_json" {
  description = "This region's JWT signing keyset JSON (docs/auth.md). Never in git: TF_VAR_signing_keyset_json."
  type        = string
  sensitive   = true
}

variable "kuberay_chart_version" {
  description = "kuberay-operator Helm chart version."
  type        = string
  default     = "1.5.1"
}

variable "ingress_class_name" {
  description = "Ingress class of the cluster's ingress controller (ingress-nginx annotations are set)."
  type        = string
  default     = "nginx"
}

variable "cluster_issuer" {
  description = "cert-manager ClusterIssuer for the TLS certificate; DNS-01, since GA regions also serve the latency-routed global name."
  type        = string
  default     = "letsencrypt-dns01"
}

variable "state_storage_class" {
  description = "StorageClass with ReadWriteMany for the API-key store shared by every router pod (null: the cluster default)."
  type        = string
  default     = null
}

variable "model_cache_path" {
  description = "Host directory on each GPU node that caches model weights across pod restarts (~35 GB per model)."
  type        = string
  default     = "/var/lib/serve_app/model-cache"
}

variable "pod_fs_group" {
  description = "fsGroup of the Ray pods: the image's user must be in it to read the signing keys and write the key store."
  type        = number
  default     = 1000
}

variable "grafana_dashboard_namespace" {
  description = "Namespace of the Grafana dashboard ConfigMap (null: the region's namespace, which Grafana's sidecar must then search)."
  type        = string
  default     = null
}

variable "registry_dsn" {
  description = "postgresql:// DSN of the key registry every region shares (docs/auth.md, section Registry). Never in git: TF_VAR_registry_dsn."
  type        = string
  sensitive   = true
}

variable "registry_dsn_env" {
  description = "The env var the routers read the registry's DSN from (the rendered Serve config's auth.key_registry_dsn_env)."
  type        = string
}

variable "registry_read_dsn" {
  description = "postgresql:// DSN of the registry instance nearest this region, for reads (terraform/global output registry_read_endpoints; empty: reads go to the primary). Never in git: TF_VAR_registry_read_dsn."
  type        = string
  sensitive   = true
}

variable "registry_read_dsn_env" {
  description = "The env var the routers read the read DSN from (the rendered Serve config's auth.key_registry_read_dsn_env)."
  type        = string
}

variable "registry_ca_bundle" {
  description = "PEM CA bundle of the registry's server certificates (RDS: global-bundle.pem), mounted for the DSNs' sslrootcert. TF_VAR_registry_ca_bundle."
  type        = string

  validation {
    condition     = startswith(trimspace(var.registry_ca_bundle), "-----BEGIN CERTIFICATE-----")
    error_message = "registry_ca_bundle is PEM: the RDS CA bundle (docs/regions.md, \"The key registry database\")."
  }
}

variable "stream_listener_ports" {
  description = "TCP ports the model replicas' stream listeners bind (SERVE_APP_STREAM_PORTS; one per replica on a pod, so a few suffice) and the NetworkPolicy opens to the region's Ray pods only."
  type        = object({ first = number, last = number })
  default     = { first = 20000, last = 20099 }

  # Clear of Ray's worker ports (ray start: 10002-19999), Serve's direct-ingress ports (30000-31000
  # HTTP, 40000-41000 gRPC) and the kernel's ephemeral range (32768-60999), which Ray's other
  # listeners draw from.
  validation {
    condition = (
      var.stream_listener_ports.first >= 20000 && var.stream_listener_ports.last <= 29999 &&
      var.stream_listener_ports.first <= var.stream_listener_ports.last
    )
    error_message = "stream_listener_ports must be a range within 20000-29999 (first <= last): below are Ray's worker ports, above Serve's direct ingress and the ephemeral ports."
  }
}

variable "stream_tls_secret" {
  description = "Kubernetes Secret (tls.crt and tls.key for stream-listener.serve-app.internal, ca.crt) that puts TLS on the router-replica byte socket; \"\" keeps it plaintext inside the NetworkPolicy (docs/threat-model.md)."
  type        = string
  default     = ""
}
