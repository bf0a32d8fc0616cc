"""The environment a Ray node must start with for this service, in a module that imports no Ray:
whoever starts the node (`make run` through ``serve_app.runtime.local_ray``, the test session,
the failover benchmark, the GPU image's smoke test) sets it before Ray's own modules read it, and
terraform/modules/region writes the same into the region's pods (a test holds them equal)."""

from serve_app import haproxy
from serve_app.config.model import REQUEST_TIMEOUT_S
from serve_app.runtime import cpus

# HAProxy, which Ray 2.60 bundles, listens on the HTTP port in place of Serve's Python proxy and
# forwards each connection to a router replica's own port (direct ingress), so no response crosses
# a Ray hop between the router and the client. Ray runs it through serve_app's launcher, which
# keeps its stats page and metrics exporter on loopback (Ray binds them to every interface;
# serve_app/haproxy/).
# What an idle cluster costs (docs/benchmarks.md, "The idle tax", "The idle floor"):
# - the Serve controller's loop every 1 s, not Ray's 0.1 s: idle, it was the cluster's busiest
#   process (8 % of a core on 2 cores; 1.2 % at 0.5 s, 0.9 % at 1 s, three GCS calls a pass plus
#   the autoscaling policies); Serve acts on what it learns up to a second after, not half a
#   second: a dead engine's replica is marked unhealthy ~3 s later (three failed checks, each
#   started and read on a pass: 13 s after an engine kill against ~10 s, docs/reliability.md), and a
#   rollout's steps (replica up, routers told, old replica stopped) add ~2-4 s, against replicas
#   that take minutes to start;
# - no idle worker kept in the raylet's pool (Ray keeps up to one per CPU): every process of ours
#   is an actor with a worker of its own, and Serve builds each application in a one-call task,
#   so a pooled worker only ever waits, at ~0.7 % of a core (its main thread, which Ray's core
#   worker wakes every 10 ms); an unused one is now stopped after 1 s;
# - Serve's cached metrics handed to Ray's metrics API every 1 s, not every 100 ms: every router,
#   replica and proxy ran that loop ten times a second (their event-loop threads, idle: 2.0 →
#   1.5 % of a core); Ray's agent exports every 10 s, so a scrape sees the same figures;
# - the dashboard agent's node and process stats (psutil over every Ray process: Prometheus reads
#   them at most 10 s old) every 10 s, not 5 s, and the scan of Ray's event files (the agent's and
#   the dashboard's events page) every 10 s, not 2 s; the dashboard's gauges of itself (CPU and
#   memory: a read of /proc/<pid>/smaps_rollup per process, its largest periodic cost; its event
#   loop's lag, now the most over a minute) every 60 s, not 5 s (docs/benchmarks.md, "The control
#   plane's intervals").
IDLE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0", "RAY_num_workers_soft_limit": "0",
            "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "REPORTER_UPDATE_INTERVAL_MS": "10000",
            "SCAN_EVENT_DIR_INTERVAL_SECONDS": "10", "METRICS_RECORD_INTERVAL_S": "60"}
# A reload of HAProxy (any change to the set of router replicas: a router restart, a num_replicas
# change, a pod moving) leaves the old HAProxy process serving the connections it holds until they
# end or, in Ray's default, 120 s after the reload: a stream still running then was cut without
# its end on every router of the node, not only the replaced ones. A request lasts at most
# REQUEST_TIMEOUT_S, so the old process now outlives every stream it holds (+30 s for the
# reload's own lag). Ray holds a stopped replica's port out of reuse this long + 30 s (660 s, of
# 1,000 ports per node).
DRAIN_ENV = {"RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": str(REQUEST_TIMEOUT_S + 30)}
RAY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", **haproxy.launcher_env(), **IDLE_ENV, **DRAIN_ENV}
# A change of a region's Ray cluster spec (a new image, an env or pod change) is a new RayCluster:
# KubeRay moves the Service to it once it serves, then deletes the old one — by default 60 s later,
# cutting every stream still running there. The old cluster stays as long as a request can last,
# and its HAProxy's drain (the RayService's rayClusterDeletionDelaySeconds, terraform/modules/region).
CLUSTER_DELETION_DELAY_S = REQUEST_TIMEOUT_S + 60
# On one small host (`make run`, the tests, the failover benchmark): one HAProxy thread instead of
# Ray's default four, which on 2 cores only contend (HAProxy CPU 0.28 → 0.17 s per 96 streams);
# HAProxy, the router and the model replica actor off the engine worker's cores (runtime/cpus.py;
# SERVE_APP_GATEWAY_CPUS set empty pins nothing, as for `make run`). Ray's log monitor (a
# region's nodes start without one: docs/operations.md) lists the log directory every 0.5 s
# instead of on every 0.1 s pass: below 1,000 tracked files Ray globs it on each pass (0.75 →
# 0.37 % of a core idle); a new process's first lines reach the console about 0.5 s later, none
# lost. (Its dashboard: runtime/local_ray.py.)
LOCAL_RAY_ENV = {**RAY_ENV, "RAY_SERVE_HAPROXY_NBTHREAD": "1", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
                 cpus.GATEWAY_CPUS_ENV: cpus.local_setting()}
