"""``serve deploy`` run by our own commands (``serve-app bench-setting``, the redeploy fault, the
failover benchmark, the GPU image's smoke test), with the environment an operator's shell would
need for it.

Ray 2.60's dashboard refuses a request without the cluster's token when the cluster runs in token
mode, which ``ray.init()`` turns on for a cluster it starts (`make run`, the test session:
docs/operations.md, "How `serve deploy` authenticates"). The ``serve`` CLI sends the token only
when its environment says ``RAY_AUTH_MODE=token``; a shell that never set it gets a 401. So the
CLI runs with that set when the caller left ``RAY_AUTH_MODE`` unset and a token exists where Ray
looks for one — what ``ray start --head`` decides for the same environment. A dashboard without
token auth ignores the header; an explicit ``RAY_AUTH_MODE`` (``disabled``) wins.
"""

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from serve_app.devtools.local_services import wait_healthy
from serve_app.hot_load.tracker import status_name  # Serve's enum or the CLI's string alike

AUTH_MODE_ENV = "RAY_AUTH_MODE"


def token_available(environ: Mapping[str, str], home: Path) -> bool:
    """Whether Ray's loader finds a token, as it looks: ``RAY_AUTH_TOKEN`` if set and not empty
    (it decides alone, blank or not), else the first line of the file ``RAY_AUTH_TOKEN_PATH``
    names, else of ``~/.ray/auth_token`` (a blank first line, or a file that cannot be read: none)."""
    token = environ.get("RAY_AUTH_TOKEN", "")
    if token:
        return bool(token.strip())
    named = environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(named) if named else home / ".ray" / "auth_token"
    try:
        with open(path) as file:
            return bool(file.readline().strip())
    except (OSError, UnicodeDecodeError):
        return False


def cli_env(environ: Mapping[str, str] | None = None, home: Path | None = None) -> dict[str, str]:
    """The environment for the ``serve`` CLI: the caller's, without ``RAY_ADDRESS`` (a driver's
    must not win over the dashboard given), with ``RAY_AUTH_MODE=token`` where a token exists and
    the caller did not choose a mode."""
    environ = os.environ if environ is None else environ
    env = {name: value for name, value in environ.items() if name != "RAY_ADDRESS"}
    if AUTH_MODE_ENV not in env and token_available(env, Path.home() if home is None else home):
        env[AUTH_MODE_ENV] = "token"
    return env


def serve_deploy(config: dict[str, Any], dashboard: str | None = None) -> subprocess.CompletedProcess:
    """``serve deploy`` of ``config`` (a config document) to ``dashboard`` (the CLI's default,
    ``http://localhost:8265``, when None); output captured, the caller reads ``returncode``."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(config, file)
        file.flush()
        command = [str(Path(sys.executable).with_name("serve")), "deploy", file.name]
        if dashboard is not None:
            command += ["--address", dashboard]
        return subprocess.run(command, capture_output=True, text=True, env=cli_env())


def deploy_or_raise(config: dict[str, Any], dashboard: str | None = None) -> None:
    """``serve_deploy``, a failure raised with the CLI's last words."""
    deployed = serve_deploy(config, dashboard)
    if deployed.returncode:
        raise RuntimeError(f"serve deploy failed: {(deployed.stderr or deployed.stdout)[-800:]}")


def serve_status(dashboard: str | None = None) -> dict[str, Any]:
    """``serve status`` of the whole instance as a dict (the CLI's YAML: ``applications[name]``
    with ``status``, ``last_deployed_time_s`` and ``deployments[name].replica_states``)."""
    command = [str(Path(sys.executable).with_name("serve")), "status"]
    if dashboard is not None:
        command += ["--address", dashboard]
    run = subprocess.run(command, capture_output=True, text=True, env=cli_env())
    if run.returncode:
        raise RuntimeError(f"serve status failed: {(run.stderr or run.stdout)[-800:]}")
    return yaml.safe_load(run.stdout) or {}


def settled(status: Mapping[str, Any], deployed_at: float, apps: Iterable[str] | None = None) -> bool:
    """Whether every application in ``apps`` (every one in ``status`` when None) was deployed
    since ``deployed_at`` (unix time) and is RUNNING with only RUNNING replicas: none starting,
    updating or draining, so what the deploy changed is what now serves. ``status`` is
    ``serve_status()``'s dict or ``dataclasses.asdict(serve.status())``. A deployment with no
    replica counts as settled (a model application's ingress entry never runs one; a cold model
    has none)."""
    applications = status.get("applications") or {}
    for name in applications if apps is None else apps:
        application = applications.get(name)
        if application is None or status_name(application.get("status")) != "RUNNING":
            return False
        if (application.get("last_deployed_time_s") or 0) < deployed_at:
            return False
        for deployment in (application.get("deployments") or {}).values():
            replicas = deployment.get("replica_states") or {}
            if {status_name(state) for state, count in replicas.items() if count} - {"RUNNING"}:
                return False
    return bool(applications)


async def until_applied(url: str, deployed_at: float, timeout_s: float = 120.0) -> None:
    """After a deploy: wait until Serve has applied it (every application deployed since
    ``deployed_at`` and RUNNING with only RUNNING replicas: ``serve_cli.settled``; a user_config
    change takes a few control-loop passes, a second each), then for /health to answer 200
    (``wait_healthy``). RuntimeError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(lambda: settled(serve_status(), deployed_at)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"serve deploy not applied within {timeout_s:.0f} s (serve status)")
        await asyncio.sleep(1.0)
    await asyncio.to_thread(wait_healthy, url, max(1.0, deadline - time.monotonic()), poll_s=1.0)
