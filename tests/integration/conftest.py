"""Start real Ray Serve with configs/local.yaml once per test session, and stop it after.

The pytest process starts its own local Ray instance (``address="local"``, so a developer's
running ``serve run`` is never touched), then deploys the config with the real ``serve deploy``
CLI against that instance's dashboard, as an SRE deploys a region. Changed from the config: the
HTTP port (a free one); the auth key store and signing keys (a tmp dir the tests also write to,
as the CLI would), a ``tiny`` rate-limit tier, and two router replicas (so the region-wide rate
limit is tested across replicas). The dev key is a random one, set before ``ray.init`` because
Ray's local workers inherit the driver's environment. Teardown shuts Serve and this Ray instance
down through their own APIs.

A second application stands for a second region, ``peer``, at ``/peer`` on the same port: its own
router, rate limiter and model deployment (the same tiny model, starting cold, half a CPU, one
request at a time), the same signing keys and key store (as regions that trust each other's
tokens), and the two regions name each other as failover peers over 127.0.0.1. The local app
keeps its config's settings, so every other test sees the embedded default.
"""

import copy
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from serve_app.auth.config import DEFAULT_TIERS, AuthArgs
from tests.conftest import free_port, load_serve_config
from tests.integration.otlp_receiver import otlp_receiver  # noqa: F401  (session fixture)

APP_NAME = "llm"
PEER_APP, PEER_REGION, PEER_PREFIX = "peer", "peer", "/peer"
STARTUP_TIMEOUT_S = 900
DEV_KEY_ENV = "SERVE_APP_DEV_API_KEY"
TINY_TIER = {"requests_per_minute": 3, "tokens_per_minute": 100_000}


def _serve_cli() -> str:
    return str(Path(sys.executable).with_name("serve"))


def _wait_until_running(dashboard: str, base_url: str, deadline: float) -> float:
    """Poll ``serve status`` and the router's /health; fail fast if the deploy fails."""
    started = time.monotonic()
    while time.monotonic() < deadline:
        status = subprocess.run(
            [_serve_cli(), "status", "--address", dashboard], capture_output=True, text=True
        )
        report = yaml.safe_load(status.stdout or "{}") or {}
        apps = report.get("applications") or {}
        statuses = {(apps.get(name) or {}).get("status") for name in (APP_NAME, PEER_APP)}
        if "DEPLOY_FAILED" in statuses:
            pytest.fail(f"serve deploy failed:\n{status.stdout}")
        if statuses == {"RUNNING"}:
            try:
                if httpx.get(f"{base_url}/health", timeout=15).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
        time.sleep(3)
    pytest.fail(f"Serve did not become ready in {STARTUP_TIMEOUT_S}s:\n{status.stdout}")


def _peer_application(local: dict, base_url: str) -> dict:
    """The ``peer`` region: a copy of the local application with its own name, prefix and region."""
    peer = copy.deepcopy(local)
    peer["name"], peer["route_prefix"] = PEER_APP, PEER_PREFIX
    args = peer["args"]
    args["region"] = PEER_REGION
    args["router"]["num_replicas"] = 1
    args["auth"].pop("dev_api_key_env", None)  # only the local region may have a dev key
    args["failover"] = {"peers": [{"region": "local", "endpoint": base_url}]}
    (model,) = args["models"]
    model["initial_state"] = "cold"
    model["resources"]["num_cpus"] = 0.5  # with the local replica (1) and the routers: under 2
    model["max_ongoing_requests"], model["max_queued_requests"] = 1, 1  # easy to overload
    return peer


def _create_key_material(auth: AuthArgs) -> None:
    """What an operator provisions before a region starts (only ``local`` creates its own)."""
    from serve_app.auth.keys import KeyStore
    from serve_app.auth.tokens import KeysetFile

    KeyStore(auth.key_store(), create=True)
    KeysetFile(auth.signing_keys(), create=True)


@pytest.fixture(scope="session")
def serve_app(tmp_path_factory, otlp_receiver):
    import ray
    from ray import serve

    port, dashboard_port = free_port(), free_port()
    config = load_serve_config("local.yaml")
    config["http_options"]["port"] = port
    args = config["applications"][0]["args"]
    auth_dir = tmp_path_factory.mktemp("auth")
    args["auth"] = {
        **args["auth"],
        "key_store_path": str(auth_dir / "keys.sqlite3"),
        "signing_keys_path": str(auth_dir / "signing-keys.json"),
        "tiers": {name: tier.model_dump() for name, tier in DEFAULT_TIERS.items()} | {"tiny": TINY_TIER},
    }
    args["router"]["num_replicas"] = 2
    # Traces go to a real OTLP receiver (Arize Phoenix) the tracing tests read back.
    args["telemetry"] = {
        "tracing": {
            "enabled": True,
            "protocol": "http/protobuf",
            "endpoint": otlp_receiver["endpoint_http"],
            "sampling_ratio": 1.0,
            "service_name": "serve_app-test",
        }
    }
    base_url = f"http://127.0.0.1:{port}"
    args["failover"] = {"peers": [{"region": PEER_REGION, "endpoint": base_url + PEER_PREFIX}]}
    _create_key_material(AuthArgs.model_validate(args["auth"]))
    config_dir = tmp_path_factory.mktemp("serve")
    config_path = config_dir / "local.yaml"  # the local region alone: what the CLI reads
    config_path.write_text(yaml.safe_dump(config))
    both = {**config, "applications": [*config["applications"], _peer_application(config["applications"][0], base_url)]}
    deployed_path = config_dir / "two-regions.yaml"
    deployed_path.write_text(yaml.safe_dump(both))
    dev_key = f"sk-test-{secrets.token_urlsafe(16)}"
    previous_env = {name: os.environ.get(name) for name in (DEV_KEY_ENV, "OTEL_BSP_SCHEDULE_DELAY")}
    os.environ[DEV_KEY_ENV] = dev_key
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export spans within 0.2 s, not 5 s

    ray.init(
        address="local",
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
    )
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    try:
        subprocess.run(
            [_serve_cli(), "deploy", str(deployed_path), "--address", dashboard],
            check=True,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
        startup_s = _wait_until_running(dashboard, base_url, time.monotonic() + STARTUP_TIMEOUT_S)
        print(f"\nServe ready at {base_url} after {startup_s:.1f}s")
        yield {
            "base_url": base_url,
            "peer_url": base_url + PEER_PREFIX,
            "app_name": APP_NAME,
            "dev_key": dev_key,
            "config_path": config_path,
            "auth": AuthArgs.model_validate(args["auth"]),
        }
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for name, value in previous_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="session")
def base_url(serve_app) -> str:
    return serve_app["base_url"]


@pytest.fixture(scope="session")
def dev_key(serve_app) -> str:
    return serve_app["dev_key"]


@pytest.fixture(scope="session")
def auth_headers(dev_key) -> dict[str, str]:
    """For raw httpx calls: the dev key as a Bearer credential."""
    return {"Authorization": f"Bearer {dev_key}"}


@pytest.fixture(scope="session")
def client(base_url, dev_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=dev_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def async_client(base_url, dev_key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=dev_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model_handle(serve_app):
    from ray import serve

    return serve.get_deployment_handle("model-qwen-3.6-35b-a3b", app_name=serve_app["app_name"])



@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
