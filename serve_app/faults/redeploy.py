"""Redeploy a changed config while streams run: every stream must complete.

The change replaces the router replicas (their init args differ), the most common production
deploy. Serve starts the new routers, moves traffic to them, and lets the old ones finish their
in-flight requests (``graceful_shutdown_timeout_s``) before stopping them. The model deployment's
args are unchanged, so its replicas (and their engines) stay.
"""

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from serve_app.faults.scenarios import _client
from serve_app.faults.traffic import chat_body, count, post_chat, stream_chat


def _cli_env() -> dict[str, str]:
    """`serve deploy` talks to the dashboard given; a RAY_ADDRESS inherited from a driver must not win."""
    return {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}


def changed_config(config: dict[str, Any], app: str) -> dict[str, Any]:
    """The same config with the router's failover connect timeout nudged by 1 ms: a change with
    no effect on behaviour that still gives the routers a new version."""
    changed = yaml.safe_load(yaml.safe_dump(config))
    (application,) = [a for a in changed["applications"] if a["name"] == app]
    failover = application["args"].setdefault("failover", {})
    failover["connect_timeout_s"] = round(float(failover.get("connect_timeout_s", 2.0)) + 0.001, 3)
    return changed


async def redeploy(
    url: str, key: str, *, config_path: Path, app: str, dashboard: str, streams: int = 8, max_tokens: int = 400,
    settle_timeout_s: float = 300,
) -> dict[str, Any]:
    config = yaml.safe_load(config_path.read_text())
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as changed:
        yaml.safe_dump(changed_config(config, app), changed)
    serve_cli = str(Path(sys.executable).with_name("serve"))
    async with _client(key, streams + 2) as client:
        started = asyncio.Event()
        running = [
            asyncio.create_task(stream_chat(client, url, chat_body(max_tokens), first_chunk=started, idle_timeout_s=120))
            for _ in range(streams)
        ]
        await asyncio.wait_for(started.wait(), 120)
        deployed_at = time.monotonic()
        deploy = await asyncio.to_thread(
            subprocess.run, [serve_cli, "deploy", changed.name, "--address", dashboard],
            capture_output=True, text=True, env=_cli_env(),
        )
        outcomes = await asyncio.gather(*running)
        after = await _settled(client, url, settle_timeout_s)
        # Put the original back (new routers again), so the suite leaves the app as it found it.
        await asyncio.to_thread(
            subprocess.run, [serve_cli, "deploy", str(config_path), "--address", dashboard],
            capture_output=True, env=_cli_env(),
        )
        await _settled(client, url, settle_timeout_s)
    Path(changed.name).unlink(missing_ok=True)
    return {
        "streams": streams,
        "deploy_exit": deploy.returncode,
        "deploy_error": deploy.stderr.strip().splitlines()[-3:] if deploy.returncode else None,
        "streams_by_outcome": count(list(outcomes)),
        "streams_ended_after_deploy_s": round(time.monotonic() - deployed_at, 1),
        "requests_after": after,
    }


async def _settled(client, url: str, timeout_s: float) -> dict[str, Any]:
    """Requests after the deploy until the app answers 200 again (it should never stop)."""
    deadline = time.monotonic() + timeout_s
    answers = []
    while time.monotonic() < deadline:
        outcome = await post_chat(client, url, chat_body(4, stream=False))
        answers.append(outcome)
        if outcome.status == 200:
            break
        await asyncio.sleep(1)
    return count(answers)
