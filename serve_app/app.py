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
# The Ray node's environment, re-exported: `from serve_app.app import RAY_ENV` as before.
from serve_app.runtime.ray_env import DRAIN_ENV, IDLE_ENV, LOCAL_RAY_ENV, RAY_ENV  # noqa: F401
from serve_app.settings import describe_errors
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

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
    return Router.options(ray_actor_options=router_actor_options(args)).bind(args)


def router_actor_options(args: dict[str, Any]) -> dict[str, Any]:
    """What one router replica asks Ray for: its CPUs, in a region the resource only the node
    holding the region's credentials offers (``RouterArgs.resources``), and its environment."""
    router = RouterArgs.model_validate(args.get("router") or {})
    options: dict[str, Any] = {"num_cpus": router.num_cpus, "runtime_env": {"env_vars": ROUTER_PROCESS_ENV}}
    if router.resources:
        options["resources"] = router.resources
    return options


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
