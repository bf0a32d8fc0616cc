"""A Ray node started on this machine (`make run`, the integration session, the failover
benchmark) runs the dashboard modules the service uses, not all nine.

Ray 2.60's dashboard runs each of its modules in a process of its own (``ray-dashboard-<Module>-0``),
every one waking a few times a second to poll the GCS even when nothing happens: 2.0 % of a core
idle for the dashboard, the largest single item of an idle local service (docs/benchmarks.md, "The
idle floor"). What the service needs of it:

- ``ServeHead``: the REST API ``serve deploy``, ``serve status``, ``serve config`` and ``serve
  shutdown`` talk to;
- ``StateHead``: Ray's state API (``ray list actors``, ``ray.util.state``), which the fault suite
  finds its victims with (serve_app/faults/cluster.py);
- ``ReportHead``: the Prometheus file-SD list of every node's metrics port
  (``/tmp/ray/prom_metrics_service_discovery.json``) and ``/api/gcs_healthz``.

Prometheus scrapes the dashboard *agent*, which stays as it is. The web UI's other pages (jobs,
nodes' graphs, Train, Data), the Prometheus and Grafana files ``MetricsHead`` writes for ``ray
metrics launch-prometheus`` and Ray's usage-stats report go with the others;
``SERVE_APP_DASHBOARD_MODULES=all`` brings them back, a comma-separated list of Ray's module
names loads those (checked against the installed Ray before the node starts). The region's
clusters keep every module: KubeRay starts their head, and their operators use the UI
(docs/operations.md); so does the GPU image's smoke test, which checks a node as a region runs it.

Ray's own switch (``include_dashboard=False``) keeps one module that is none of these; the
dashboard's ``--modules-to-load`` flag is not reachable from ``ray.init`` or ``serve run``. So the
process that starts the node adds the flag to the dashboard's command line as Ray spawns it
(``start_ray_process`` in ``ray._private.services``: one function, checked by the unit tests
against the installed Ray). A Ray without that function starts its full dashboard, with a warning.

``python -m serve_app.runtime.local_ray run <config>`` is ``serve run <config>`` with that done,
and with the environment a local node runs with (``serve_app.runtime.ray_env.LOCAL_RAY_ENV``:
HAProxy through serve_app's launcher, the idle settings, the gateway's CPUs) set before Ray
starts, so `make run` names none of it again. A variable already in the environment wins
(``RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 make run``).
"""

import logging
import os
import sys
from collections.abc import Callable, Sequence

MODULES_ENV = "SERVE_APP_DASHBOARD_MODULES"
MODULES = ("ServeHead", "StateHead", "ReportHead")
_FLAG = "--modules-to-load"

# module_logger's name without telemetry's imports (as runtime/cpus.py), spelled out: `make run`
# runs this module as __main__.
logger = logging.getLogger("ray.serve.serve_app.runtime.local_ray")


def dashboard_modules(env: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """The modules to load (``MODULES`` unless the variable names others); None for every one.
    A list is checked against this Ray's modules: Ray's dashboard exits on a name it does not
    have, and ``serve run`` then goes on without one (``serve deploy`` and ``serve status`` fail
    on a refused connection). ValueError naming the ones there are."""
    value = (os.environ if env is None else env).get(MODULES_ENV, "").strip()
    if not value:
        return MODULES
    if value.lower() == "all":
        return None
    named = tuple(name.strip() for name in value.split(",") if name.strip())
    known = available_modules()
    if not named or not set(named) <= known:
        unknown = ", ".join(sorted(set(named) - known)) or "none"
        raise ValueError(
            f"{MODULES_ENV}={value!r}: not Ray dashboard modules: {unknown}. Ray {_ray_version()} has "
            f"{', '.join(sorted(known))}; or 'all'"
        )
    return named


def available_modules() -> set[str]:
    """The names of this Ray's dashboard modules (imports them: about a second)."""
    from ray.dashboard.subprocesses.module import SubprocessModule
    from ray.dashboard.utils import DashboardHeadModule, get_all_modules

    return {cls.__name__ for kind in (DashboardHeadModule, SubprocessModule) for cls in get_all_modules(kind)}


def _ray_version() -> str:
    import ray

    return ray.__version__


def with_modules(start: Callable, modules: Sequence[str]) -> Callable:
    """``start`` (Ray's ``start_ray_process``), with ``--modules-to-load`` on a dashboard's
    command that names none: the only process of the node it changes."""
    from ray._private import ray_constants

    def start_ray_process(command, process_type, *args, **kwargs):
        if process_type == ray_constants.PROCESS_TYPE_DASHBOARD and not any(
            arg.startswith(_FLAG) for arg in command
        ):
            command = [*command, f"{_FLAG}={','.join(modules)}"]
        return start(command, process_type, *args, **kwargs)

    start_ray_process.serve_app_modules = tuple(modules)
    start_ray_process.__wrapped__ = start  # what a later trim_dashboard wraps instead
    return start_ray_process


def trim_dashboard(env: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """Before this process starts a Ray node: its dashboard loads ``dashboard_modules()`` only
    (``all``: Ray's own function again). Returns what it will load (None: every module)."""
    from ray._private import services

    modules = dashboard_modules(env)
    start = getattr(services, "start_ray_process", None)
    if start is None:
        logger.warning("this Ray has no services.start_ray_process: its dashboard loads every module")
        return None
    if getattr(start, "serve_app_modules", None) is not None:  # trimmed once already
        start = services.start_ray_process = start.__wrapped__
    if modules is None:
        return None
    services.start_ray_process = with_modules(start, modules)
    return modules


def set_ray_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``LOCAL_RAY_ENV`` into ``env`` (this process's environment), what it already has left as
    it is; returns what was set. Ray's processes take it from the one that starts the node."""
    from serve_app.runtime.ray_env import LOCAL_RAY_ENV

    env = os.environ if env is None else env
    added = {name: value for name, value in LOCAL_RAY_ENV.items() if name not in env}
    env.update(added)
    return added


def main(argv: list[str]) -> None:
    """``serve <argv>`` in this process, with ``LOCAL_RAY_ENV``, on a node whose dashboard
    ``trim_dashboard`` trimmed."""
    try:
        trim_dashboard()
    except ValueError as err:
        raise SystemExit(f"serve_app.runtime.local_ray: {err}") from None
    set_ray_environment()
    from ray.serve.scripts import cli

    cli.main(args=argv, prog_name="serve")


if __name__ == "__main__":
    main(sys.argv[1:])
