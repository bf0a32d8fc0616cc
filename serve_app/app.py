"""``build_app(args)``: the application builder a Serve config's ``import_path`` names.

It validates ``args`` (see ``serve_app.config``), binds one ``ModelServer`` deployment per model
with its autoscaling, queue bounds and Ray resources, and binds the ``Router`` ingress in front of
them.
"""

from typing import Any

from ray.serve import Application

from serve_app.config import AppArgs, ModelDeploymentArgs, parse_app_args
from serve_app.engine.deployment import ModelServer
from serve_app.router.ingress import Router


def model_deployment_options(model: ModelDeploymentArgs) -> dict[str, Any]:
    """Serve options for one model's deployment (kept separate so unit tests can read them)."""
    ray_actor_options: dict[str, Any] = {"num_cpus": model.resources.num_cpus}
    if model.resources.num_gpus:
        ray_actor_options["num_gpus"] = model.resources.num_gpus
    if model.resources.accelerator_type:
        ray_actor_options["accelerator_type"] = model.resources.accelerator_type
    if model.resources.env:
        ray_actor_options["runtime_env"] = {"env_vars": dict(model.resources.env)}
    return {
        "name": model.deployment_name,
        "autoscaling_config": model.autoscaling.model_dump(exclude_none=True),
        "max_ongoing_requests": model.max_ongoing_requests,
        "max_queued_requests": model.max_queued_requests,
        "graceful_shutdown_timeout_s": model.graceful_shutdown_timeout_s,
        # Loading weights (and on CPU, compiling kernels) takes a while; do not kill it early.
        "health_check_timeout_s": 60,
        "ray_actor_options": ray_actor_options,
    }


def build(args: AppArgs) -> Application:
    models = {
        model.id: ModelServer.options(**model_deployment_options(model)).bind(model)
        for model in args.models
    }
    return Router.options(
        num_replicas=args.router.num_replicas,
        max_ongoing_requests=args.router.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.router.num_cpus},
    ).bind(models, args.region, args.auth, args.telemetry)


def build_app(args: dict[str, Any]) -> Application:
    return build(parse_app_args(args))
