"""``build_app(args)``: the application builder a Serve config's ``import_path`` names.

It validates ``args`` (see ``serve_app.config``), binds one ``ModelServer`` deployment per model
with its autoscaling, queue bounds and Ray resources, and binds the ``Router`` ingress in front of
them.
"""

import os
from typing import Any

from ray.serve import Application

from serve_app import catalog, haproxy
from serve_app.config import ENGINE_ENV, TINY_MODEL_SOURCE, AppArgs, ModelDeploymentArgs, parse_app_args
from serve_app.engine.deployment import ModelServer
from serve_app.hot_load.autoscaling import POLICY_PATH
from serve_app.router.ingress import Router
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# The environment the Ray cluster itself must start with (the Makefile, the test session and
# terraform/modules/region set it): HAProxy, which Ray 2.60 bundles, listens on the HTTP port in
# place of Serve's Python proxy and forwards each connection to a router replica's own port
# (direct ingress), so no response crosses a Ray hop between the router and the client. Ray runs
# it through serve_app's launcher, which keeps its stats page and metrics exporter on loopback
# (Ray binds them to every interface; serve_app/haproxy/).
RAY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", **haproxy.launcher_env()}
# On one small host (`make run`, the tests, the failover benchmark): one HAProxy thread instead of
# Ray's default four, which on 2 cores only contend (HAProxy CPU 0.28 → 0.17 s per 96 streams).
LOCAL_RAY_ENV = {**RAY_ENV, "RAY_SERVE_HAPROXY_NBTHREAD": "1"}
# The router replica's own process. Its FastAPI code, Serve's handle router and the direct-ingress
# HTTP server share one event loop, so a relayed read is one ASGI send on the loop that owns the
# client socket, not a message handed across threads (-25 % router CPU, docs/architecture.md).
# A request waiting in Serve's queue for a free replica re-polls with a backoff that grows to
# 0.5 s by default, leaving a freed slot idle that long; 50 ms keeps it busy at small cost.
ROUTER_PROCESS_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_ROUTER_RETRY_MAX_BACKOFF_S": "0.05",
}


def autoscaling_config(model: ModelDeploymentArgs) -> dict[str, Any]:
    """Serve's autoscaling for a model: our hot-load policy between 0 and the region's maximum.

    Serve's bounds start at 0 so an unloaded model can run no replica; the policy keeps a loaded
    one at ``min_replicas`` or more and applies the region's scaling delays itself (Serve's own
    are zeroed: they would also delay loads and unloads; serve_app/hot_load/autoscaling.py).
    """
    scaling = model.autoscaling
    loaded_initial = scaling.initial_replicas or scaling.min_replicas
    return {
        "min_replicas": 0,
        "initial_replicas": loaded_initial if model.initial_state == "loaded" else 0,
        "max_replicas": scaling.max_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        "downscale_to_zero_delay_s": 0,
        "policy": {
            "policy_function": POLICY_PATH,
            "policy_kwargs": {
                "min_replicas": scaling.min_replicas,
                "initial_state": model.initial_state,
                "upscale_delay_s": scaling.upscale_delay_s,
                "downscale_delay_s": scaling.downscale_delay_s,
                "drain_timeout_s": model.graceful_shutdown_timeout_s,
            },
        },
    }


def model_deployment_options(model: ModelDeploymentArgs) -> dict[str, Any]:
    """Serve options for one model's deployment (kept separate so unit tests can read them)."""
    ray_actor_options: dict[str, Any] = {"num_cpus": model.resources.num_cpus}
    if model.resources.num_gpus:
        ray_actor_options["num_gpus"] = model.resources.num_gpus
    if model.resources.accelerator_type:
        ray_actor_options["accelerator_type"] = model.resources.accelerator_type
    # The config's env, then what the engine must run with whatever the config says.
    ray_actor_options["runtime_env"] = {"env_vars": {**model.resources.env, **ENGINE_ENV}}
    return {
        "name": model.deployment_name,
        "autoscaling_config": autoscaling_config(model),
        "max_ongoing_requests": model.max_ongoing_requests,
        "max_queued_requests": model.max_queued_requests,
        "graceful_shutdown_timeout_s": model.graceful_shutdown_timeout_s,
        "health_check_period_s": model.health_check_period_s,
        "health_check_timeout_s": model.health_check_timeout_s,
        "ray_actor_options": ray_actor_options,
    }


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


def build(args: AppArgs) -> Application:
    for warning in ray_env_warnings():
        logger.warning(warning)
    models = {
        model.id: ModelServer.options(**model_deployment_options(model)).bind(model, resolve_model_path(model))
        for model in args.models
    }
    return Router.options(
        num_replicas=args.router.num_replicas,
        max_ongoing_requests=args.router.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.router.num_cpus, "runtime_env": {"env_vars": ROUTER_PROCESS_ENV}},
    ).bind(models, args)


def build_app(args: dict[str, Any]) -> Application:
    return build(parse_app_args(args))
