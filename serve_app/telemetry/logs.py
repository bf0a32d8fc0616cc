"""Module loggers for the serving processes.

Serve writes a replica's log from its own ``ray.serve`` logger only: its handlers (the replica's
log file, stderr) and the filters that add the deployment, replica and request id hang there,
and it does not propagate. A module's logger is therefore its child, ``ray.serve.<module>``: its
records reach the replica's log with Serve's context, and one module's level can be set on its
own (``logging.getLogger("ray.serve.serve_app.usage").setLevel(logging.DEBUG)``).
"""

import logging

SERVE_LOGGER = "ray.serve"


def module_logger(module: str) -> logging.Logger:
    """``module_logger(__name__)``."""
    return logging.getLogger(f"{SERVE_LOGGER}.{module}")
