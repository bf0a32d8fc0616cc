"""Request metrics reach Prometheus through Ray's metrics agent (what a scrape of the node sees)."""

import time
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"


def _scrape(serve_app) -> str:
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_ttft_latency_tokens_and_errors_are_exported(serve_app, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    for _ in stream:
        pass
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[], max_tokens=1)

    wanted = {
        "ray_serve_app_time_to_first_token_seconds_count": {"region": "local", "model": MODEL},
        "ray_serve_app_request_latency_seconds_count": {"model": MODEL, "status": "200"},
        "ray_serve_app_queue_time_seconds_count": {"model": MODEL},
        "ray_serve_app_output_tokens_total": {"model": MODEL},
        "ray_serve_app_errors_total": {"status": "404"},
    }
    deadline = time.monotonic() + 90  # Ray's metrics agent reports every ~10 s
    missing = wanted
    while missing and time.monotonic() < deadline:
        text = _scrape(serve_app)
        missing = {name: labels for name, labels in wanted.items() if not _sample(text, name, **labels)}
        if missing:
            time.sleep(5)
    assert not missing, f"not exported: {sorted(missing)}"


def _dashboard_modules() -> set[str]:
    """The modules the session's dashboard runs, each a ``ray-dashboard-<Module>-0`` process (forked by
    the dashboard's forkserver, a child of the dashboard)."""
    import psutil
    import ray
    from ray._private import ray_constants

    (dashboard,) = ray._private.worker._global_node.all_processes[ray_constants.PROCESS_TYPE_DASHBOARD]
    titles = [child.cmdline()[0].split(" ", 1)[0] for child in psutil.Process(dashboard.process.pid).children(recursive=True)]
    return {title.removeprefix("ray-dashboard-").rsplit("-", 1)[0] for title in titles if title.startswith("ray-dashboard-")}


def test_the_dashboard_runs_what_serve_deploy_the_state_api_and_prometheus_use(serve_app):
    """As on `make run`'s node (serve_app/runtime/local_ray.py): `serve deploy` deployed the session
    through ServeHead, the fault suite finds its replicas through StateHead, and ReportHead lists
    the node's metrics port for Prometheus's file-SD."""
    import json

    import ray

    from serve_app.faults import cluster
    from serve_app.runtime import local_ray

    assert _dashboard_modules() == set(local_ray.MODULES)
    assert cluster.routers(serve_app["app_name"])  # ray.util.state.list_actors
    port = ray.nodes()[0]["MetricsExportPort"]
    listing = Path(ray._private.worker._global_node.get_session_dir_path()) / "prom_metrics_service_discovery.json"
    deadline = time.monotonic() + 30
    targets: list[str] = []
    while time.monotonic() < deadline:
        try:
            targets = [t for group in json.loads(listing.read_text()) for t in group["targets"]]
        except (OSError, ValueError):
            targets = []
        if any(t.endswith(f":{port}") for t in targets):
            break
        time.sleep(1)
    assert any(t.endswith(f":{port}") for t in targets), (listing, targets)
