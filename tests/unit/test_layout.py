"""The package's rooms: nothing loose at the top that belongs in a package, and no serving
process importing the development tooling."""

import subprocess
import sys

from tests.conftest import REPO

# The top level keeps what every room uses: the app builder, the CLI entry point, the catalog of
# model facts, the one error shape, and where generated files live (the validated args are a room:
# serve_app/config/).
TOP_LEVEL = {"__init__.py", "app.py", "cli.py", "catalog.py", "errors.py", "paths.py"}


def test_serve_app_has_no_loose_module_beyond_the_core():
    loose = {path.name for path in (REPO / "serve_app").glob("*.py")}
    assert loose == TOP_LEVEL


def test_every_module_is_listed_in_the_readme_layout_table():
    readme = (REPO / "README.md").read_text()
    rooms = sorted({path.parent.name for path in (REPO / "serve_app").glob("*/__init__.py")})
    missing = [room for room in rooms if f"`serve_app/{room}/`" not in readme]
    missing += [name for name in TOP_LEVEL - {"__init__.py"} if name not in readme]
    assert not missing


def test_the_serving_processes_import_no_dev_tooling():
    script = (
        "import sys\n"
        "import serve_app.app, serve_app.engine.deployment, serve_app.router.ingress\n"
        "print(sorted(m for m in sys.modules if m.startswith('serve_app.devtools')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_serving_modules_log_under_serves_logger_by_module_name():
    """Serve writes a replica's log from ``ray.serve``'s handlers only (it does not propagate):
    a serving module's logger is its child, so its records land there, under its own name."""
    import logging

    from serve_app.router import relay
    from serve_app.usage import ledger

    serve_logger = logging.getLogger("ray.serve")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    serve_logger.addHandler(handler)
    try:
        ledger.logger.warning("from the ledger")
        relay.logger.warning("from the relay")
    finally:
        serve_logger.removeHandler(handler)
    assert [(r.name, r.getMessage()) for r in seen] == [
        ("ray.serve.serve_app.usage.ledger", "from the ledger"),
        ("ray.serve.serve_app.router.relay", "from the relay"),
    ]
    # Only the client library (used outside Serve) names a logger of its own, and the CPU placement
    # and the local node's start, which HAProxy's launcher and `make run` import without
    # telemetry's 0.7 s of imports, the AMX and gloo plugins every vLLM process runs, and the
    # hot-load policy the Serve controller runs: under
    # Serve's logger by the same name module_logger gives.
    named = subprocess.run(
        ["grep", "-rln", "--include=*.py", "logging.getLogger(", "serve_app"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    assert sorted(named) == ["serve_app/client/auth.py", "serve_app/client/transport.py", "serve_app/engine/amx.py",
                             "serve_app/engine/gloo.py", "serve_app/hot_load/autoscaling.py",
                             "serve_app/runtime/cpus.py", "serve_app/runtime/local_ray.py",
                             "serve_app/telemetry/logs.py"]
    from serve_app.engine import amx, gloo
    from serve_app.runtime import cpus, local_ray
    from serve_app.telemetry.logs import module_logger

    assert cpus.logger is module_logger(cpus.__name__) and amx.logger is module_logger(amx.__name__)
    assert local_ray.logger is module_logger(local_ray.__name__) and gloo.logger is module_logger(gloo.__name__)
    from serve_app.hot_load import autoscaling

    assert autoscaling.logger is module_logger(autoscaling.__name__)


def test_every_surface_is_one_row_with_its_route_replica_method_and_vllm_handler():
    """A surface is its row (serve_app/surfaces), its body model and its vLLM call: the router's
    route, the replica's method and the engine's handler all come from, or answer to, the table."""
    from serve_app import surfaces
    from serve_app.engine.deployment import ModelServer
    from serve_app.engine.vllm_engine import HANDLERS
    from serve_app.router import ingress

    surface_routes = {route.path: route for route in ingress.app.routes if route.name in surfaces.BY_NAME}
    assert {path: route.name for path, route in surface_routes.items()} == {
        surface.route: surface.name for surface in surfaces.SURFACES
    }  # made from the rows, one each, and none written beside them
    for surface in surfaces.SURFACES:
        assert surface_routes[surface.route].methods == {"POST"}, surface
        assert callable(getattr(ModelServer.func_or_class, surface.name)), surface
    assert set(HANDLERS) == set(surfaces.BY_NAME)
    # The limit a generating surface's engine obeys is in its row, nowhere else.
    assert {s.name for s in surfaces.SURFACES if s.generates} == {"chat", "completions", "responses", "messages"}
