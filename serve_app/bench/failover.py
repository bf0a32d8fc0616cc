"""What a failover costs: the same streaming benchmark served locally and through a peer region.

Starts its own Ray on free ports, deploys two regions on 127.0.0.1 (``serve_app.devtools.local_regions``:
``local`` with the model loaded, ``peer`` with it cold), and runs ``serve_app.bench`` against
``local`` directly and against ``peer``, whose router forwards every request to ``local``. Both
targets end in the same engine, so the difference is the failover hop: the peer router's
auth, state check and forwarding, one more pass through the Serve proxy, and the relay back.
Then it shuts Serve and its Ray down.

    .venv/bin/python -m serve_app.bench.failover --runs 100 --out bench-results/failover.json
"""

import os
import tempfile
from pathlib import Path
from typing import Annotated

import httpx
import typer
import yaml

from serve_app.app import LOCAL_RAY_ENV
from serve_app.auth.keys import KeyStore
from serve_app.bench import bench_target, free_port, report, wait_healthy
from serve_app.devtools.local_regions import PEER_PREFIX, create_key_material, two_region_config
from serve_app.devtools.serve_cli import deploy_or_raise
from serve_app.paths import REPO_ROOT
from serve_app.regions import layout
from serve_app.runtime.local_ray import trim_dashboard

READY_TIMEOUT_S = 900


def _check_it_fails_over(peer_url: str, model: str, api_key: str) -> None:
    """The peer target must really be served by ``local`` through failover, or the figures lie."""
    response = httpx.post(
        f"{peer_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {api_key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=120,
    )
    served_by = (response.status_code, response.headers.get("x-pg-region"), response.headers.get("x-pg-failover-from"))
    if served_by != (200, "local", "peer"):
        raise RuntimeError(f"the peer target did not fail over to local: {served_by}")


def main(
    runs: int = 100,
    max_tokens: int = 32,
    warmup: int = 3,
    out: Annotated[Path, typer.Option(help="JSON with every run.")] = Path("bench-results/failover.json"),
) -> None:
    import ray
    from ray import serve

    port, dashboard_port = free_port(), free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        local_config = yaml.safe_load((REPO_ROOT / "configs" / "local.yaml").read_text())
        config = two_region_config(local_config, port, Path(tmp))
        local = layout.parse_region(config, layout.ROUTER_APP)
        auth = local.auth
        create_key_material(auth)
        # Allowed in every region (the dev key is local-only, so it could not fail over).
        api_key, _ = KeyStore(auth.key_store()).create_key(owner="bench-failover", tier="enterprise")

        os.environ.update(LOCAL_RAY_ENV)  # HAProxy in front of the routers, as every region runs
        trim_dashboard({})  # as `make run`'s node by default (serve_app/runtime/local_ray.py)
        ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard_port)
        try:
            deploy_or_raise(config, f"http://127.0.0.1:{dashboard_port}")
            print(f"two regions ready after {wait_healthy(base_url, READY_TIMEOUT_S):.1f} s")
            model = local.models[0].id
            _check_it_fails_over(base_url + PEER_PREFIX, model, api_key)
            results = {
                "local": bench_target(base_url, model, runs, max_tokens, warmup, api_key),
                "failover": bench_target(base_url + PEER_PREFIX, model, runs, max_tokens, warmup, api_key),
            }
            report(results, {"model": model, "runs": runs, "max_tokens": max_tokens, "what": "failover"}, out)
        finally:
            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    typer.run(main)
