# The region's Ray cluster and Serve application. serveConfigV2 is configs/<id>.yaml verbatim:
# what `serve deploy` would deploy by hand is exactly what runs here.
#
# kubernetes_manifest needs the RayService CRD at plan time: on a new cluster, apply the operator
# first (`terraform apply -target=module.region.helm_release.kuberay_operator`), then the rest.

locals {
  # The launcher's fixed path in var.image (terraform/image/Dockerfile links it).
  haproxy_launcher = "/opt/serve_app/bin/serve-app-haproxy"
  stream_ports     = "${var.stream_listener_ports.first}-${var.stream_listener_ports.last}"
  # The worker group every model replica runs in (one GPU per pod); KubeRay labels its pods
  # ray.io/group with this name (network_policy.tf selects them by it).
  gpu_worker_group = "blackwell"

  env = [
    { name = "OTEL_EXPORTER_OTLP_ENDPOINT", value = var.region.otlp_endpoint },
    { name = "OTEL_SERVICE_NAME", value = local.name },
    { name = "OTEL_RESOURCE_ATTRIBUTES", value = "cloud.region=${var.region.id}" },
    { name = "HF_HOME", value = "/models/hf" },
    # HAProxy in place of Serve's Python proxy (serve_app.app.RAY_ENV; docs/architecture.md), run
    # through serve_app's launcher: its stats (8404) and metrics (9101) ports on the pod's
    # loopback, not its IP (serve_app/haproxy/; the image links the launcher there).
    { name = "RAY_SERVE_ENABLE_HA_PROXY", value = "1" },
    { name = "RAY_SERVE_HAPROXY_BINARY_PATH", value = local.haproxy_launcher },
    # What an idle cluster costs (serve_app.app.IDLE_ENV): the Serve controller's loop every 1 s,
    # not 0.1 s; no idle worker kept in the raylet's pool (each costs ~0.7 % of a core doing
    # nothing); Serve's cached metrics handed to Ray's every 1 s, not 100 ms; the dashboard
    # agent's node stats and event-file scan every 10 s; the dashboard's own gauges every 60 s.
    { name = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", value = "1.0" },
    { name = "RAY_num_workers_soft_limit", value = "0" },
    { name = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", value = "1000" },
    { name = "REPORTER_UPDATE_INTERVAL_MS", value = "10000" },
    { name = "SCAN_EVENT_DIR_INTERVAL_SECONDS", value = "10" },
    { name = "METRICS_RECORD_INTERVAL_S", value = "60" },
    # An old HAProxy process keeps the streams it holds after a reload until they end, not 120 s
    # (Ray's default cut every longer stream of the node): the request timeout + 30 s
    # (serve_app.runtime.ray_env.DRAIN_ENV).
    { name = "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S", value = "630" },
    # The model replicas' stream listeners take their port from this range, the one the
    # NetworkPolicy opens to the region's Ray pods only (network_policy.tf).
    { name = "SERVE_APP_STREAM_PORTS", value = local.stream_ports },
  ]

  # The shared key registry (main.tf): its primary and the instance to read from; Ray's workers
  # inherit the pod's env. The head's alone, as the signing keys and the spool (auth_volumes):
  # the routers run there only (they ask for var.region.head.resources), so a model's GPU pod,
  # whose engine fetches and decodes callers' media, holds no credential (docs/threat-model.md).
  registry_env = [
    {
      name      = var.registry_dsn_env
      valueFrom = { secretKeyRef = { name = kubernetes_secret_v1.registry.metadata[0].name, key = "dsn" } }
    },
    {
      name      = var.registry_read_dsn_env
      valueFrom = { secretKeyRef = { name = kubernetes_secret_v1.registry.metadata[0].name, key = "read_dsn" } }
    },
  ]

  auth_volumes = [
    {
      name = "signing-keys"
      # 0440: readable by the pod's fsGroup, not by the world.
      secret = { secretName = kubernetes_secret_v1.signing_keys.metadata[0].name, defaultMode = 288 }
    },
    {
      name                  = "state"
      persistentVolumeClaim = { claimName = kubernetes_persistent_volume_claim_v1.state.metadata[0].name }
    },
    {
      name      = "registry-ca"
      configMap = { name = kubernetes_config_map_v1.registry_ca.metadata[0].name }
    },
  ]

  auth_mounts = [
    { name = "signing-keys", mountPath = var.auth_mounts.signing_keys_dir, readOnly = true },
    { name = "state", mountPath = var.auth_mounts.state_dir },
    { name = "registry-ca", mountPath = var.auth_mounts.registry_ca_dir, readOnly = true },
  ]

  # TLS on the byte socket, a region option (serve_app/wire/tls.py, docs/threat-model.md): the
  # Secret's files where the replicas (their certificate) and the routers (the CA) read them.
  stream_tls_dir = "/etc/serve-app/stream-tls"
  stream_tls     = var.stream_tls_secret != ""
  stream_tls_env = local.stream_tls ? [
    { name = "SERVE_APP_STREAM_TLS_CERT", value = "${local.stream_tls_dir}/tls.crt" },
    { name = "SERVE_APP_STREAM_TLS_KEY", value = "${local.stream_tls_dir}/tls.key" },
    { name = "SERVE_APP_STREAM_TLS_CA", value = "${local.stream_tls_dir}/ca.crt" },
  ] : []
  # 0440, as the signing keys.
  stream_tls_volumes = local.stream_tls ? [{ name = "stream-tls", secret = { secretName = var.stream_tls_secret, defaultMode = 288 } }] : []
  stream_tls_mounts  = local.stream_tls ? [{ name = "stream-tls", mountPath = local.stream_tls_dir, readOnly = true }] : []

  # GCS fault tolerance (a region option: kubernetes.gcs_redis): the GCS keeps its state in the
  # region's highly available Redis, so a lost head pod restarts alone and the workers' actors
  # (the model replicas; the routers run on the head and restart with it) live on; KubeRay sets
  # the workers' reconnect timeout.
  # Without it the head's loss restarts every Ray pod (docs/operations.md, "Node maintenance").
  gcs_fault_tolerance = {
    for key, options in {
      gcsFaultToleranceOptions = {
        redisAddress  = var.region.gcs_redis.address
        redisPassword = { valueFrom = { secretKeyRef = { name = var.region.gcs_redis.password_secret, key = "password" } } }
      }
    } : key => options if var.region.gcs_redis.address != ""
  }

  # The head (the routers, the Serve controller) gets the region's credentials; a GPU worker (the
  # model replicas) what an engine and its stream listener need, and nothing of the routers'.
  # The registry's DSNs reach the routers as env vars, read once as a process starts: a Secret
  # changed under a running pod (a rotated password) reached no pod, and the first reconnect after
  # the old password was gone failed in every region at once. Their digest in the pod template
  # makes a change of them a new cluster, rolled out as any (docs/operations.md, "Rotating
  # secrets"); a secret named by var (stream TLS, Redis) changes with its name.
  secrets_digest  = nonsensitive(sha256(jsonencode([var.registry_dsn, var.registry_read_dsn])))
  pod_annotations = { "polargrid.ai/secrets-digest" = local.secrets_digest }

  head_env     = concat(local.env, local.registry_env, local.stream_tls_env)
  head_volumes = concat(local.auth_volumes, local.stream_tls_volumes)
  head_mounts  = concat(local.auth_mounts, local.stream_tls_mounts)
  worker_env   = concat(local.env, local.stream_tls_env)

  head_resources = {
    cpu    = tostring(var.region.head.cpus)
    memory = "${var.region.head.memory_gib}Gi"
  }

  # One GPU per worker pod, as one GPU per model replica.
  worker_resources = {
    cpu              = tostring(var.region.gpu_worker.cpus)
    memory           = "${var.region.gpu_worker.memory_gib}Gi"
    "nvidia.com/gpu" = "1"
  }
}

locals {
  # The RayCluster every rollout builds (KubeRay's rayClusterConfig), GCS fault tolerance aside.
  ray_cluster = {
    rayVersion              = var.ray_version
    enableInTreeAutoscaling = true
    autoscalerOptions = {
      # Matches the Serve autoscaler's downscale delay: a GPU pod outlives its last replica.
      idleTimeoutSeconds = 600
    }

    # The head runs the Serve controller, the routers and a proxy; no GPU, no model.
    # No log monitor on any node: it polls every log file ten times a second (~1 % of a core,
    # idle) to push their lines to a driver's terminal, and a region has no driver (serve
    # deploy goes through the dashboard; logs are read from files: docs/operations.md). "0", not
    # "false": the KubeRay this module pins (1.5) omits a rayStartParams value "false" for this
    # flag (only "true" becomes a bare flag; fixed upstream by kuberay#4857), and ray start reads
    # "0" as false.
    # The resource every router replica asks for, offered here alone (as JSON in a quoted string,
    # which KubeRay passes to `ray start --resources` and its autoscaler reads): routers never
    # land on a GPU worker, and a pending router never scales the GPU group.
    headGroupSpec = {
      rayStartParams = {
        "dashboard-host"      = "0.0.0.0"
        "include-log-monitor" = "0"
        "resources"           = jsonencode(jsonencode(var.region.head.resources))
      }
      template = {
        metadata = { labels = local.labels, annotations = local.pod_annotations }
        spec = {
          securityContext = { fsGroup = var.pod_fs_group }
          containers = [{
            name  = "ray-head"
            image = var.image
            env   = local.head_env
            ports = [
              { name = "gcs", containerPort = 6379 },
              { name = "dashboard", containerPort = 8265 },
              { name = "client", containerPort = 10001 },
              { name = "serve", containerPort = 8000 },
            ]
            resources    = { requests = local.head_resources, limits = local.head_resources }
            volumeMounts = local.head_mounts
          }]
          volumes = local.head_volumes
        }
      }
    }

    # One pod per Blackwell GPU, only on the tainted GPU pool. Ray sees the GPU's model as
    # accelerator_type (RTX-PRO-6000, B200), which the Serve config pins each replica to.
    workerGroupSpecs = [{
      groupName   = local.gpu_worker_group
      replicas    = var.region.gpu_workers.min
      minReplicas = var.region.gpu_workers.min
      maxReplicas = var.region.gpu_workers.max
      rayStartParams = {
        "include-log-monitor" = "0"
        # The accelerator_type resource each replica asks for, stated: KubeRay's autoscaler
        # learns what a new pod would offer from this spec alone (CPU, GPU and memory from the
        # container, custom resources from here), never from the raylet's own detection — so
        # without it no node type fits a replica and the group never grows past min. The
        # raylet sets the same key to 1 on a node of that GPU anyway.
        "resources" = "\"{\\\"accelerator_type:${var.region.accelerator_type}\\\": 1}\""
      }
      template = {
        metadata = { labels = local.labels }
        spec = {
          securityContext = { fsGroup = var.pod_fs_group }
          # A deleted or evicted worker pod (a node drain, an upgrade) drains its Ray node first
          # (the preStop below): Serve moves its replicas, each stopped once its replacement runs
          # or at the latest with the time its requests may still take, and its HAProxy finishes
          # the connections it holds. Kubernetes' default of 30 s before SIGKILL cut every stream
          # of the node. serve_app/runtime/drain_node.py: TERMINATION_GRACE_S, DRAIN_DEADLINE_S.
          terminationGracePeriodSeconds = 660
          nodeSelector                  = local.gpu_pool_labels
          # One GPU worker per server before a second on any (soft: a pod still starts where
          # only one server has a free GPU): a region's two replicas on one server go down
          # together with it, and its required model with them. Counted per RayCluster
          # (matchLabelKeys): a rollout's new workers spread among themselves, not around the
          # old cluster's. Applied when a pod is scheduled; nothing moves a pod later.
          topologySpreadConstraints = [{
            maxSkew           = 1
            topologyKey       = "kubernetes.io/hostname"
            whenUnsatisfiable = "ScheduleAnyway"
            labelSelector = { matchLabels = {
              "app.kubernetes.io/name" = local.name
              "ray.io/group"           = local.gpu_worker_group
            } }
            matchLabelKeys = ["ray.io/cluster"]
          }]
          tolerations = [{
            key      = local.gpu_taint.key
            operator = "Equal"
            value    = local.gpu_taint.value
            effect   = local.gpu_taint.effect
          }]
          # The kubelet creates the hostPath cache as root:root 0755, and fsGroup does not
          # apply to hostPath volumes: hand it to the image's user (uid/gid 1000, the pod's
          # fsGroup) before vLLM, running as that user, downloads weights into it.
          initContainers = [{
            name    = "model-cache-owner"
            image   = var.image
            command = ["sh", "-c", "chown ${var.pod_fs_group}:${var.pod_fs_group} /models && chmod 2775 /models"]
            securityContext = {
              runAsUser                = 0
              runAsNonRoot             = false
              allowPrivilegeEscalation = false
              capabilities             = { drop = ["ALL"], add = ["CHOWN", "FOWNER"] }
            }
            volumeMounts = [{ name = "model-cache", mountPath = "/models" }]
          }]
          containers = [{
            name      = "ray-worker"
            image     = var.image
            env       = local.worker_env
            resources = { requests = local.worker_resources, limits = local.worker_resources }
            lifecycle = { preStop = { exec = { command = ["serve-app", "drain-node", "--deadline-s", "630"] } } }
            volumeMounts = concat(local.stream_tls_mounts, [
              { name = "model-cache", mountPath = "/models" },
              { name = "shm", mountPath = "/dev/shm" },
            ])
          }]
          volumes = concat(local.stream_tls_volumes, [
            # Node-local weight cache: a replica restarting on the same server skips the download.
            { name = "model-cache", hostPath = { path = var.model_cache_path, type = "DirectoryOrCreate" } },
            # vLLM's workers exchange tensors through shared memory.
            { name = "shm", emptyDir = { medium = "Memory", sizeLimit = "16Gi" } },
          ])
        }
      }
    }]
  }
}

resource "kubernetes_manifest" "rayservice" {
  manifest = {
    apiVersion = "ray.io/v1"
    kind       = "RayService"
    metadata = {
      name      = local.name
      namespace = kubernetes_namespace_v1.serve.metadata[0].name
      labels    = local.labels
    }
    spec = {
      serveConfigV2    = var.serve_config
      rayClusterConfig = merge(local.gcs_fault_tolerance, local.ray_cluster)
      # A cluster spec change (image, env, pods) starts a new RayCluster; the old one is deleted
      # this long after the Service moved off it, not KubeRay's 60 s: every stream it still holds
      # ends first (request timeout 600 s + 60; serve_app.runtime.ray_env.CLUSTER_DELETION_DELAY_S).
      rayClusterDeletionDelaySeconds = 660
    }
  }

  depends_on = [
    helm_release.kuberay_operator,
    kubernetes_labels.gpu_node,
    kubernetes_node_taint.gpu_node,
  ]
}
