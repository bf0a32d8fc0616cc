"""A Ray node started on this machine (`make run`, the integration session, the failover
benchmark) runs the dashboard modules the service uses, not all ten.

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
nodes' graphs, Train, Data) go with the others; ``SERVE_APP_DASHBOARD_MODULES=all`` brings them
back. The region's clusters keep every module: KubeRay starts their head, and their operators use
the UI (docs/operations.md).

Ray's own switch (``include_dashboard=False``) keeps one module that is none of these; the
dashboard's ``--modules-to-load`` flag is not reachable from ``ray.init`` or ``serve run``. So the
process that starts the node adds the flag to the dashboard's command line as Ray spawns it
(``start_ray_process`` in ``ray._private.services``: one function, checked by the unit tests
against the installed Ray). A Ray without that function starts its full dashboard, with a warning.

``python -m serve_app.runtime.local_ray run <config>`` is ``serve run <config>`` with that done.
"""

import logging
import os
import sys
from collections.abc import Callable, Sequence

MODULES_ENV = "SERVE_APP_DASHBOARD_MODULES"
MODULES = ("ServeHead", "StateHead", "ReportHead")
_FLAG = "--modules-to-load"

# module_logger's name without telemetry's imports (as runtime/cpus.py): `make run` imports this.
logger = logging.getLogger(f"ray.serve.{__name__}")


def dashboard_modules(env: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """The modules to load (``MODULES`` unless the variable names others); None for every one."""
    value = (os.environ if env is None else env).get(MODULES_ENV, "").strip()
    if not value:
        return MODULES
    if value.lower() == "all":
        return None
    return tuple(name.strip() for name in value.split(",") if name.strip())


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
    return start_ray_process


def trim_dashboard(env: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """Before this process starts a Ray node: its dashboard loads ``dashboard_modules()`` only.
    Returns what it will load (None: every module)."""
    modules = dashboard_modules(env)
    if modules is None:
        return None
    try:
        from ray._private import services
    except ImportError:  # pragma: no cover - Ray is a dependency
        return None
    start = getattr(services, "start_ray_process", None)
    if start is None:
        logger.warning("this Ray has no services.start_ray_process: its dashboard loads every module")
        return None
    if getattr(start, "serve_app_modules", None) is not None:  # done once already
        start = start.__wrapped__
    wrapped = with_modules(start, modules)
    wrapped.__wrapped__ = start
    services.start_ray_process = wrapped
    return modules


def main(argv: list[str]) -> None:
    """``serve <argv>`` in this process, on a node whose dashboard ``trim_dashboard`` trimmed."""
    trim_dashboard()
    from ray.serve.scripts import cli

    cli.main(args=argv, prog_name="serve")


if __name__ == "__main__":
    main(sys.argv[1:])
