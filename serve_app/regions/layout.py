"""A region's settings (``serve_app.config.AppArgs``) as Serve applications, and back.

Where a setting sits in a Serve config decides what ``serve deploy`` restarts when it changes
(Ray 2.60; docs/operations.md, "What a change restarts"):

- an application's ``args`` are hashed into the code version of every deployment it builds
  (``_private/deploy_utils.py:158-198``, ``get_app_code_version``), and a new code version
  restarts every replica (``_private/version.py:70-83``, ``requires_actor_restart``), whatever
  the change was. So does a deployment's autoscaling ``policy`` (its kwargs too,
  ``deploy_utils.py:173-177``) and its ``ray_actor_options``;
- a deployment's other options in the config's ``deployments:`` list are applied to the running
  replicas: ``user_config`` by calling their ``reconfigure()`` (``version.py:85-89``), the queue
  bounds, autoscaling bounds, health checks and shutdown timeout by the controller alone
  (``_private/config.py:177-269``, each option's ``update_type``).

So a region is one application per model plus the router's own, each setting placed by what
changing it needs:

``<router app>`` (``llm``; route ``/``): ``args`` are what a router replica reads once, when it
    starts (``ROUTER_STARTUP``: a change restarts the router replicas, new ones first, the old
    ones drained); the ``Router`` deployment's options are its replica count, request bound and
    shutdown timeout, and its ``user_config`` is every other setting of the region (auth, rate
    limits, failover, responses, usage, and every model's entry as written), applied in place.
``<router app>-<model id>`` (no route): ``args`` are what the model's engine is built from
    (``MODEL_ENGINE``: a change restarts that model's replicas only, new ones first); its
    deployment's options are Serve's knobs for it (queue bounds, autoscaling, health checks,
    shutdown timeout), applied in place, but for the hot-load policy's own settings, which Serve
    hashes with the code (above).

Every deployment surges (``max_surge_percent``): a replica that must be replaced is stopped only
once its replacement passes its health check (``_private/deployment_state.py:4203-4330``), then
drained for up to ``graceful_shutdown_timeout_s``.

The router's ``user_config`` with its application's ``args`` is the whole region (``region_args``);
every other part of the config is derived from it (``region_applications``), and ``problems`` says
where a config is not what its settings render. Nothing here imports Ray.
"""

import copy
from typing import Any

from serve_app.config import REQUEST_TIMEOUT_S, AppArgs, ModelDeploymentArgs, parse_app_args, request_router_config

ROUTER_DEPLOYMENT = "Router"
ROUTER_APP = "llm"
ROUTER_IMPORT_PATH = "serve_app.app:build_router"
MODEL_IMPORT_PATH = "serve_app.app:build_model"
POLICY_PATH = "serve_app.hot_load.autoscaling:HotLoadPolicy"
# Replacements a rolling update may start before stopping what they replace, as a percentage of
# the target count: all of them. Without capacity for them the old replicas keep serving and the
# replacements wait (``_private/config.py``, ``max_surge_percent``); Serve's default, 0, stops the
# old replica first, which with one replica is an outage.
SURGE_PERCENT = 100

# What a router replica reads once, when it starts (``None``: the whole section): its identity
# (rate limiter, usage writer, traces), the process-wide tracer, its Ray resources, and where the
# registry and the ledger's spool are (the ledger's writer and the stored responses are bound
# to them). In the router application's args, so a change restarts the router replicas.
ROUTER_STARTUP: dict[str, tuple[str, ...] | None] = {
    "region": None,
    "telemetry": None,
    "router": ("num_cpus", "resources"),
    "auth": ("key_store_path", "key_registry_dsn_env", "key_registry_read_dsn_env"),
    "usage": ("spool_dir",),
}
# The Router deployment's own options (Serve applies them in place).
ROUTER_OPTIONS = ("num_replicas", "max_ongoing_requests", "graceful_shutdown_timeout_s")
# What a model's engine is built from: the model application's args.
MODEL_ENGINE = ("id", "engine", "resources", "media")


def model_app_name(router_app: str, model_id: str) -> str:
    """The application a router's model runs in; two regions on one host (``local`` and
    ``peer``, devtools/local_regions.py) keep theirs apart by their router's name."""
    return f"{router_app}-{model_id}"


def tidy(value: Any) -> Any:
    """Whole floats as ints (24.0 -> 24) so the YAML reads as written; everything else as is."""
    if isinstance(value, dict):
        return {k: tidy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tidy(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# --- the router's settings: read at start, or applied in place ----------------------------------
def split_startup(written: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``written`` (a region's settings as written) as (the router's args, its user_config).
    Of ``router``, ``ROUTER_OPTIONS`` go to neither: they are the Router deployment's options."""
    startup: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for key, value in written.items():
        if key not in ROUTER_STARTUP:
            settings[key] = value
        elif (fields := ROUTER_STARTUP[key]) is None:
            startup[key] = value
        else:
            if at_start := {k: v for k, v in value.items() if k in fields}:
                startup[key] = at_start
            options = ROUTER_OPTIONS if key == "router" else ()
            if rest := {k: v for k, v in value.items() if k not in fields and k not in options}:
                settings[key] = rest
    return startup, settings


def merge_settings(startup: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The router's args and user_config as one region's settings; ValueError when both set one."""
    merged = copy.deepcopy(startup)
    for key, value in settings.items():
        if key not in merged:
            merged[key] = copy.deepcopy(value)
            continue
        both = set(merged[key]) & set(value) if isinstance(value, dict) and isinstance(merged[key], dict) else {key}
        if both:
            where = ", ".join(f"{key}.{name}" if name != key else key for name in sorted(both))
            raise ValueError(f"{where}: set in both the router's args and its user_config (it belongs in one)")
        merged[key] = {**merged[key], **copy.deepcopy(value)}
    return merged


# --- settings -> applications -------------------------------------------------------------------
def autoscaling_config(model: ModelDeploymentArgs) -> dict[str, Any]:
    """Serve's autoscaling for a model: our hot-load policy between a floor and the region's maximum.

    Serve's floor is 0 so an unloaded model can run no replica — except for a model the region's
    health requires (``region_health: required``, never unloadable: 409 ``model_required``), whose
    floor is its ``min_replicas``: with 0, a new Ray cluster (KubeRay's rollout of a new image)
    reported the application RUNNING at once, with no engine started (Serve counts the policy's
    later raise as autoscaling), and KubeRay switched the region's traffic to it for the whole
    engine start; with the floor, the application is DEPLOYING until that many replicas are
    healthy. A Serve floor keeps a replica count across config changes as 0 does (``register``
    clips the current target to it). The policy keeps a loaded model at ``min_replicas`` or more,
    starts a load at ``initial_replicas``, lets an unload wait for the requests in flight (at
    most as long as a request may last), and applies the region's
    scaling delays itself (Serve's own are zeroed: they would also delay loads and unloads;
    serve_app/hot_load/autoscaling.py). Serve's ``initial_replicas`` stays unset: Serve resets the
    target to it on every change of the deployment's config (``_private/autoscaling_state.py``,
    ``register``), so a light change would stop the replicas a load or the autoscaler added.
    """
    scaling = model.autoscaling
    return {
        "min_replicas": scaling.min_replicas if model.region_health == "required" else 0,
        "max_replicas": scaling.max_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        "downscale_to_zero_delay_s": 0,
        "policy": {
            "policy_function": POLICY_PATH,
            "policy_kwargs": {
                "min_replicas": scaling.min_replicas,
                "initial_replicas": scaling.initial_replicas or scaling.min_replicas,
                "initial_state": model.initial_state,
                "upscale_delay_s": scaling.upscale_delay_s,
                "downscale_delay_s": scaling.downscale_delay_s,
                # Not graceful_shutdown_timeout_s: that would make it a restart to change.
                "drain_timeout_s": REQUEST_TIMEOUT_S,
            },
        },
    }


def model_serve_options(model: ModelDeploymentArgs) -> dict[str, Any]:
    """The model deployment's options in the Serve config (its ``deployments:`` entry)."""
    return {
        "name": model.deployment_name,
        "max_ongoing_requests": model.max_ongoing_requests,
        "max_queued_requests": model.max_queued_requests,
        "graceful_shutdown_timeout_s": model.graceful_shutdown_timeout_s,
        "health_check_period_s": model.health_check_period_s,
        "health_check_timeout_s": model.health_check_timeout_s,
        "max_surge_percent": SURGE_PERCENT,
        "autoscaling_config": autoscaling_config(model),
        "request_router_config": request_router_config(model.routing),
    }


def region_applications(raw: dict[str, Any], *, name: str = ROUTER_APP, route_prefix: str = "/") -> list[dict[str, Any]]:
    """A region's settings (``AppArgs``, as written) as its Serve applications: the router's,
    then one per model. ValueError when the settings are invalid."""
    args = parse_app_args(raw)
    written = tidy(args.model_dump(mode="json", exclude_unset=True))
    startup, settings = split_startup(written)
    router = {
        "name": name,
        "route_prefix": route_prefix,
        "import_path": ROUTER_IMPORT_PATH,
        "args": startup,
        "deployments": [
            {
                "name": ROUTER_DEPLOYMENT,
                **{option: getattr(args.router, option) for option in ROUTER_OPTIONS},
                "max_surge_percent": SURGE_PERCENT,
                "user_config": settings,
            }
        ],
    }
    models = [
        {
            "name": model_app_name(name, model.id),
            "route_prefix": None,  # reached by the router's handle only
            "import_path": MODEL_IMPORT_PATH,
            "args": {"model": {key: entry[key] for key in MODEL_ENGINE if key in entry}},
            "deployments": [model_serve_options(model)],
        }
        for model, entry in zip(args.models, written["models"], strict=True)
    ]
    return tidy([router, *models])


def expand(compact: dict[str, Any]) -> dict[str, Any]:
    """A Serve config whose applications are regions (``name``, ``route_prefix``, ``args``: the
    region's settings) as the config Serve deploys (regions/local/serve.yaml -> configs/local.yaml)."""
    expanded = {key: value for key, value in compact.items() if key != "applications"}
    expanded["applications"] = [
        application
        for region in compact["applications"]
        for application in region_applications(
            region.get("args") or {}, name=region["name"], route_prefix=region.get("route_prefix", "/")
        )
    ]
    return expanded


# --- applications -> settings -------------------------------------------------------------------
def router_applications(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [app for app in config.get("applications") or [] if app.get("import_path") == ROUTER_IMPORT_PATH]


def router_deployment(application: dict[str, Any]) -> dict[str, Any]:
    found = [d for d in application.get("deployments") or [] if d.get("name") == ROUTER_DEPLOYMENT]
    if len(found) != 1:
        raise ValueError(f"application {application.get('name')!r} has no {ROUTER_DEPLOYMENT} deployment options")
    return found[0]


def region_args(config: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The settings (as written) of the region whose router application is ``name`` (default:
    the config's only one): its args, its user_config and its deployment options, as one."""
    routers = router_applications(config)
    chosen = [app for app in routers if name is None or app.get("name") == name]
    if len(chosen) != 1:
        names = ", ".join(str(app.get("name")) for app in routers) or "none"
        raise ValueError(f"expected one router application{f' named {name!r}' if name else ''} (routers: {names})")
    (application,) = chosen
    deployment = router_deployment(application)
    raw = merge_settings(application.get("args") or {}, deployment.get("user_config") or {})
    options = {option: deployment[option] for option in ROUTER_OPTIONS if option in deployment}
    if options:
        raw["router"] = {**raw.get("router", {}), **options}
    return raw


def parse_region(config: dict[str, Any], name: str | None = None) -> AppArgs:
    return parse_app_args(region_args(config, name))


# --- the drift check ----------------------------------------------------------------------------
def problems(config: dict[str, Any]) -> list[str]:
    """Where ``config`` is not what its regions' settings render: a setting in the wrong place (so
    a change of it would restart what it should not, or not reach what it should), a model
    application out of step with the router's entry, or one no router serves. Empty: it holds."""
    found: list[str] = []
    actual = {app.get("name"): app for app in config.get("applications") or []}
    claimed: set[str] = set()
    for router in router_applications(config):
        try:
            expected = region_applications(
                region_args(config, router["name"]), name=router["name"], route_prefix=router.get("route_prefix", "/")
            )
        except ValueError as err:
            found.append(f"{router['name']}: {err}")
            continue
        for application in expected:
            claimed.add(application["name"])
            if application["name"] not in actual:
                found.append(f"{application['name']}: missing; the {router['name']} router's settings list its model")
            elif where := first_difference(application, actual[application["name"]]):
                found.append(f"{application['name']}: {where}")
    for name, application in actual.items():
        if application.get("import_path") == MODEL_IMPORT_PATH and name not in claimed:
            found.append(f"{name}: a model application no router's settings list")
    return found


def first_difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """The first place ``actual`` differs from ``expected``, said as a path and both values."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in [*expected, *(k for k in actual if k not in expected)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in actual:
                return f"{where} is missing (rendered: {expected[key]!r})"
            if key not in expected:
                return f"{where} should not be here (it is {actual[key]!r}; its region's settings put it elsewhere)"
            if difference := first_difference(expected[key], actual[key], where):
                return difference
        return None
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        for index, (left, right) in enumerate(zip(expected, actual)):
            if difference := first_difference(left, right, f"{path}[{index}]"):
                return difference
        return None
    return None if expected == actual else f"{path} is {actual!r}; its region's settings render {expected!r}"
