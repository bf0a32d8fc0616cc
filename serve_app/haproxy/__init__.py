"""serve_app's launcher for the HAProxy that Ray Serve 2.60 runs in front of the routers.

Ray renders HAProxy's config itself (``ray/serve/_private/haproxy_templates.py``) and gives no
knob for where two of its listeners bind: the stats page (``listen stats``, ``bind *:8404``) and
the Prometheus exporter (``frontend prometheus``, ``bind :9101``) take every interface; only
their ports are settable (``RAY_SERVE_HAPROXY_STATS_PORT``, ``RAY_SERVE_HAPROXY_METRICS_PORT``,
integers). What Ray does let us choose is the binary: ``RAY_SERVE_HAPROXY_BINARY_PATH``. It
points at ``serve-app-haproxy`` (``launch.py``), which, before it execs Ray's bundled HAProxy
with the very same arguments (same pid, same ``-f``, so Ray's pid and cmdline checks hold):

- pins those two binds to loopback (``admin_binds.py``; ``SERVE_APP_HAPROXY_STATS_HOST`` and
  ``SERVE_APP_HAPROXY_METRICS_HOST`` name another address, e.g. a pod IP to scrape);
- makes the answers HAProxy gives itself (a malformed request, no router reachable) JSON in the
  API's error shape instead of HTML (``error_pages.py``);
- on the first start of a node's HAProxy, removes other nodes' state directories under
  ``/tmp/haproxy-serve`` that no running process uses (``state_dirs.py``).

Nothing here imports Ray: the launcher runs on every HAProxy start and reload.
"""

import os
import sysconfig
from pathlib import Path

LAUNCHER = "serve-app-haproxy"  # the console script (pyproject.toml [project.scripts])
BINARY_PATH_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Ray's: the HAProxy binary it runs


def launcher_path() -> Path:
    """Where this environment installed ``serve-app-haproxy`` (beside its ``python``, ``serve``)."""
    return Path(sysconfig.get_path("scripts")) / LAUNCHER


def launcher_env() -> dict[str, str]:
    """The environment Ray must start with to run HAProxy through the launcher; empty when the
    launcher is not installed (a venv older than pyproject.toml: ``make setup``), so that Ray
    still finds a binary and only the binds stay Ray's."""
    path = launcher_path()
    return {BINARY_PATH_ENV: str(path)} if os.access(path, os.X_OK) else {}


def is_launcher(path: str | None) -> bool:
    """Whether ``path`` (Ray's ``RAY_SERVE_HAPROXY_BINARY_PATH``) runs this launcher, directly or
    through a link (the image links it at a fixed path for terraform/modules/region)."""
    return bool(path) and os.path.basename(os.path.realpath(path)) == LAUNCHER and os.access(path, os.X_OK)
