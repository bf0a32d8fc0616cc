"""The application builders a Serve config's ``import_path`` names: ``build_router(args)`` for a
region's router and ``build_model(args)`` for each of its models, one Serve application each
(serve_app/regions/layout.py says what goes where, and why).

A builder binds only what its ``args`` say, which Serve hashes into the application's code version:
the router's Ray resources and what it reads at start, a model's engine and Ray resources. Every
other option (replica counts, queue bounds, autoscaling, health checks, shutdown timeouts, the
router's ``user_config``) is the config's ``deployments:`` entry, which Serve applies in place.
"""

import os
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from serve_app import catalog, haproxy
from serve_app.config import ENGINE_ENV, TINY_MODEL_SOURCE, ModelDeploymentArgs, RouterArgs
from serve_app.engine.deployment import ModelServer
from serve_app.router.ingress import Router
from serve_app.runtime import cpus
from serve_app.settings import describe_errors
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# The environment the Ray cluster itself must start with (`make run` through
# serve_app.runtime.local_ray, the test session and terraform/modules/region set it): HAProxy,
# which Ray 2.60 bundles, listens on the HTTP port in place of Serve's Python proxy and forwards
# each connection to a router replica's own port (direct ingress), so no response crosses a Ray
# hop between the router and the client. Ray runs it through serve_app's launcher, which keeps its
# stats page and metrics exporter on loopback (Ray binds them to every interface; serve_app/haproxy/).
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
RAY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", **haproxy.launcher_env(), **IDLE_ENV}
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
# The router replica's own process. Its FastAPI code, Serve's handle router and the direct-ingress
# HTTP server share one event loop, so a relayed read is one ASGI send on the loop that owns the
# client socket, not a message handed across threads (-25 % router CPU, docs/architecture.md).
# (How soon a request waiting for a free replica polls again is the model deployment's
# request_router_config, serve_app/config/model.py ROUTER_BACKOFF_S: Serve 2.60 reads it there.)
ROUTER_PROCESS_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
# A model replica's own process: vLLM's serving layer, the direct lines and the byte sockets on
# Serve's event loop, not on a second loop in a thread of its own beside it (fewer GIL hand-offs
# and cross-thread wake-ups). Measured taking turns at 16 streams (docs/benchmarks.md, "One event
# loop in the model replica"): TTFT p95 lower in 4 of 4 rounds (median 87 against 98 ms), tok/s
# +2 %, the replica actor's CPU per token -3 %. A region's config can set it back (resources.env).
MODEL_PROCESS_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def model_actor_options(model: ModelDeploymentArgs) -> dict[str, Any]:
    """What one model replica asks Ray for, and its environment (kept separate so unit tests can
    read them)."""
    ray_actor_options: dict[str, Any] = {"num_cpus": model.resources.num_cpus}
    if model.resources.num_gpus:
        ray_actor_options["num_gpus"] = model.resources.num_gpus
    if model.resources.accelerator_type:
        ray_actor_options["accelerator_type"] = model.resources.accelerator_type
    # Our process default, the config's env, then what the engine must run with whatever it says.
    ray_actor_options["runtime_env"] = {"env_vars": {**MODEL_PROCESS_ENV, **model.resources.env, **ENGINE_ENV}}
    return ray_actor_options


def resolve_model_path(model: ModelDeploymentArgs) -> str:
    """The weights the engine loads: the configured source, else the catalog's HF repo; for the
    CPU default's ``tiny-local``, the generated tiny checkpoint of the model's task (the chat
    model's stand-in, or the embedding model's). Resolved here, when the app is built, so that no
    serving process imports the dev tooling that generates it."""
    entry = catalog.get(model.id)
    source = model.engine.source or entry.hf_repo
    if source == TINY_MODEL_SOURCE and entry.task == "embed":
        from serve_app.devtools.tiny_embedding_model import ensure_tiny_embedding_model

        return str(ensure_tiny_embedding_model())
    if source == TINY_MODEL_SOURCE:
        from serve_app.devtools.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    return source


def ray_env_warnings(environ=os.environ) -> list[str]:
    """What the running Ray lacks of ``RAY_ENV``, and what that costs (it reads it when it starts)."""
    warnings = []
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        warnings.append(
            "Ray was started without RAY_SERVE_ENABLE_HA_PROXY=1: responses take Serve's Python proxy, "
            "one Ray hop per relayed read (docs/architecture.md, 'The token path')"
        )
    elif not haproxy.is_launcher(environ.get(haproxy.BINARY_PATH_ENV)):
        warnings.append(
            f"Ray was started without {haproxy.BINARY_PATH_ENV} naming {haproxy.LAUNCHER}: HAProxy's "
            "stats page and metrics exporter listen on every interface (docs/operations.md, 'Ports')"
        )
    return warnings


def build_router(args: dict[str, Any]) -> Application:
    """The router application: ``args`` are what a router replica reads when it starts
    (``layout.ROUTER_STARTUP``), checked whole by its first ``reconfigure``."""
    for warning in ray_env_warnings():
        logger.warning(warning)
    num_cpus = RouterArgs.model_validate(args.get("router") or {}).num_cpus
    return Router.options(
        ray_actor_options={"num_cpus": num_cpus, "runtime_env": {"env_vars": ROUTER_PROCESS_ENV}},
    ).bind(args)


# Serve takes no num_replicas=0; scaled to zero, it starts none and nothing ever scales it up.
@serve.deployment(autoscaling_config={"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1})
class ModelEntry:
    """A model application's ingress, never started (no replica, no cost).

    Serve 2.60 refuses a custom request router on an application's ingress deployment when
    HAProxy is on (HAProxy would bypass it), and the model deployment runs ours
    (serve_app/routing/router.py) — so the model deployment is this one's child, reached by the
    router's handle alone; nothing ever calls this."""

    def __init__(self, model: Any):
        self.model = model


def build_model(args: dict[str, Any]) -> Application:
    """One model's application: ``args["model"]`` is what its engine is built from
    (``layout.MODEL_ENGINE``)."""
    model = parse_model_args(args)
    server = ModelServer.options(name=model.deployment_name, ray_actor_options=model_actor_options(model))
    return ModelEntry.bind(server.bind(model, resolve_model_path(model)))


def parse_model_args(args: dict[str, Any]) -> ModelDeploymentArgs:
    if set(args) != {"model"}:
        raise ValueError(f"a model application's args are {{model: {{...}}}}, got keys {sorted(args)}")
    try:
        return ModelDeploymentArgs.model_validate(args["model"])
    except ValidationError as err:
        problems = "\n".join(f"  {line}" for line in describe_errors(err, "args.model"))
        raise ValueError("invalid model args:\n" + problems) from None
