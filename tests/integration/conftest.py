"""Start real Ray Serve with configs/local.yaml once per test session, and stop it after.

The pytest process starts its own local Ray instance (``address="local"``, so a developer's
running ``serve run`` is never touched), then deploys the config with the real ``serve deploy``
CLI against that instance's dashboard, as an SRE deploys a region. Changed from the config: the
HTTP port (a free one); the auth key store and signing keys (a tmp dir the tests also write to,
as the CLI would), a ``tiny`` rate-limit tier, and two router replicas (so the region-wide rate
limit is tested across replicas). The dev key is a random one, set before ``ray.init`` because
Ray's local workers inherit the driver's environment. Teardown shuts Serve and this Ray instance
down through their own APIs.

A second region, ``peer``, stands beside it at ``/peer`` on the same port
(``serve_app.devtools.local_regions``: its own router, rate limiter and cold model deployment; the same
keys; each region the other's failover peer over 127.0.0.1). Each region is laid out as a region
config is (serve_app/regions/layout.py): its router's application (``llm``, ``peer``) and one per
model (``llm-qwen-3.6-35b-a3b``, ``peer-qwen-3.6-35b-a3b``). The local region keeps its config's
settings, so every other test sees the embedded default — but for its key registry: both regions
share one on a real PostgreSQL server (a fresh database on the session's server, its DSN in
``SERVE_APP_REGISTRY_DSN``), as regions do; ``make run`` keeps the SQLite file.
"""

import os
import secrets
import time

import httpx
import openai
import pytest
import yaml

from serve_app.app import LOCAL_RAY_ENV
from serve_app.auth.config import DEFAULT_TIERS
from serve_app.devtools.local_regions import PEER_PREFIX, create_key_material, two_region_config
from serve_app.devtools.serve_cli import deploy_or_raise
from serve_app.faults.scenarios import MODEL_DEPLOYMENT, model_app
from serve_app.hot_load.tracker import status_name
from serve_app.regions.layout import parse_region
from serve_app.runtime.local_ray import trim_dashboard
from tests.conftest import free_port, load_serve_config
from tests.integration.otlp_receiver import otlp_receiver  # noqa: F401  (session fixture)

APP_NAME = "llm"
STARTUP_TIMEOUT_S = 900
DEV_KEY_ENV = "SERVE_APP_DEV_API_KEY"
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
TINY_TIER = {"requests_per_minute": 3, "tokens_per_minute": 100_000}
REGISTRY_ENV = "SERVE_APP_REGISTRY_DSN"


def _wait_until_running(base_url: str, deadline: float, names: list[str]) -> float:
    """Poll Serve's status (every application in ``names``; in this process, the session's Ray
    driver: ``serve status`` costs ~2 s of imports a poll on two cores busy starting engines) and
    the router's /health until every model it serves is loaded; fail fast if the deploy fails."""
    from ray import serve

    started, statuses = time.monotonic(), {}
    while time.monotonic() < deadline:
        apps = serve.status().applications
        statuses = {name: status_name(apps[name].status) if name in apps else None
                    for name in names}
        if "DEPLOY_FAILED" in statuses.values():
            pytest.fail(f"serve deploy failed: { {name: apps[name].message for name in names if name in apps} }")
        if set(statuses.values()) == {"RUNNING"}:
            try:
                # Every model of the region serving, not only one: a model that autoscales from
                # zero is RUNNING in Serve's status while its first replica still loads.
                health = httpx.get(f"{base_url}/health", timeout=15)
                if health.status_code == 200 and all(health.json()["models"].values()):
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
        time.sleep(1)
    pytest.fail(f"Serve did not become ready in {STARTUP_TIMEOUT_S}s: {statuses}")


@pytest.fixture(scope="session")
def registry_dsn(postgres_dsn) -> str:
    """The two regions' shared key registry: a fresh database on the session's PostgreSQL."""
    from tests.postgres_server import new_database

    return new_database(postgres_dsn, "registry")


@pytest.fixture(scope="session")
def serve_app(tmp_path_factory, otlp_receiver, registry_dsn):
    import ray
    from ray import serve

    port, dashboard_port = free_port(), free_port()
    base_url = f"http://127.0.0.1:{port}"
    def for_the_session(args: dict) -> None:
        args["auth"]["key_registry_dsn_env"] = REGISTRY_ENV
        tiers = {name: tier.model_dump() for name, tier in DEFAULT_TIERS.items()} | {"tiny": TINY_TIER}
        args["auth"]["tiers"] = tiers
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
        if args["region"] == "local":
            args["router"]["num_replicas"] = 2
            # The local region hands its streams over (as configs/local.yaml does; off by default
            # elsewhere: wire/handoff.py), so every stream test runs through it end to end; the
            # peer region relays them, as GPU regions do by default.
            args["router"]["hand_off_streams"] = True
        else:
            # The peer region calls its replicas as Ray actor tasks (router.handle_transport); the
            # local region by the default, its replicas' direct lines (and gRPC for what goes
            # through the handle): both run end to end, failover included.
            args["router"]["handle_transport"] = "actor"
            args["router"]["hand_off_streams"] = False

    config = two_region_config(
        load_serve_config("local.yaml"), port, tmp_path_factory.mktemp("auth"), adjust=for_the_session
    )
    local_apps = [a for a in config["applications"] if a["name"] == APP_NAME or a["name"].startswith(f"{APP_NAME}-")]
    previous_env = {name: os.environ.get(name) for name in (DEV_KEY_ENV, REGISTRY_ENV, "OTEL_BSP_SCHEDULE_DELAY", *LOCAL_RAY_ENV, *HAPROXY_PORTS)}
    os.environ[REGISTRY_ENV] = registry_dsn  # before ray.init: Ray's local workers inherit it
    auth = parse_region(config, APP_NAME).auth
    create_key_material(auth)
    config_dir = tmp_path_factory.mktemp("serve")
    config_path = config_dir / "local.yaml"  # the local region alone: what the CLI reads
    config_path.write_text(yaml.safe_dump({**config, "applications": local_apps}))
    deployed_path = config_dir / "two-regions.yaml"
    deployed_path.write_text(yaml.safe_dump(config))
    dev_key = f"sk-test-{secrets.token_urlsafe(16)}"
    os.environ[DEV_KEY_ENV] = dev_key
    os.environ.update(LOCAL_RAY_ENV)  # HAProxy in front of the routers, as `make run` and regions run
    # HAProxy's stats and metrics ports are fixed by default (8404, 9101): free ones, so the
    # session runs beside a developer's `make run`.
    os.environ.update({name: str(free_port()) for name in HAPROXY_PORTS})
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export spans within 0.2 s, not 5 s
    trim_dashboard({})  # the modules `make run`'s node runs by default (serve_app/runtime/local_ray.py)

    ray.init(
        address="local",
        # Logical CPUs, for placement only (the host has 2 cores): a model redeploy surges a new
        # replica beside the old one before draining it (tests/integration/test_redeploy.py); on 2
        # logical CPUs the two regions' deployments (the peer's model loaded) leave it no room,
        # and the deploy stalls.
        num_cpus=4,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
    )
    dashboard = f"http://127.0.0.1:{dashboard_port}"
    try:
        deploy_or_raise(config, dashboard)
        names = [a["name"] for a in config["applications"]]
        startup_s = _wait_until_running(base_url, time.monotonic() + STARTUP_TIMEOUT_S, names)
        print(f"\nServe ready at {base_url} after {startup_s:.1f}s")
        yield {
            "base_url": base_url,
            "peer_url": base_url + PEER_PREFIX,
            "app_name": APP_NAME,
            "dev_key": dev_key,
            "config_path": config_path,
            "deployed_path": deployed_path,  # both regions: what a redeploy sends
            "dashboard": dashboard,
            "auth": auth,
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


def pytest_collection_modifyitems(items):
    """Tests marked ``disruptive`` (they kill an engine or redeploy the app) run last, so every
    other test sees a steady service whatever order the files are collected in."""
    items.sort(key=lambda item: item.get_closest_marker("disruptive") is not None)


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

    return serve.get_deployment_handle(MODEL_DEPLOYMENT, app_name=model_app(serve_app["app_name"]))


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


# --- the peer region's model state: tests say what they need, not what ran before them ----------
PEER_MODEL = "qwen-3.6-35b-a3b"
PEER_LOAD_TIMEOUT_S = 600  # a vLLM CPU engine starting next to another one on 2 cores
PEER_UNLOAD_TIMEOUT_S = 180


@pytest.fixture(scope="session")
def peer_admin_key(serve_app) -> str:
    from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, KeyStore

    store = KeyStore(serve_app["auth"].key_store(), cache_ttl_s=0)
    key, _ = store.create_key(owner="it-peer-state", tier="standard",
                              scopes=(SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR))
    return key


def bring_peer_to(serve_app, admin_key: str, wanted: str, timeout_s: float) -> None:
    """Load (``loaded``) or unload (``cold``) the peer region's model unless it is so already,
    and wait until it is."""
    url, headers = serve_app["peer_url"], {"Authorization": f"Bearer {admin_key}"}

    def state() -> str:
        card = httpx.get(f"{url}/v1/models/{PEER_MODEL}", headers=headers, timeout=30)
        assert card.status_code == 200, card.text
        return card.json()["state"]

    if state() == wanted:
        return
    action = "load" if wanted == "loaded" else "unload"
    asked = httpx.post(f"{url}/v1/models/{action}", headers=headers, json={"model": PEER_MODEL}, timeout=30)
    assert asked.status_code in (200, 202), asked.text
    deadline = time.monotonic() + timeout_s
    while (now := state()) != wanted:
        assert now != "failed" and time.monotonic() < deadline, f"the peer's model is {now}, not {wanted}"
        time.sleep(1)


@pytest.fixture
def peer_cold(serve_app, peer_admin_key) -> None:
    """The peer region's model is cold: its requests fail over to local."""
    bring_peer_to(serve_app, peer_admin_key, "cold", PEER_UNLOAD_TIMEOUT_S)


@pytest.fixture
def peer_loaded(serve_app, peer_admin_key) -> None:
    """The peer region serves its model itself."""
    bring_peer_to(serve_app, peer_admin_key, "loaded", PEER_LOAD_TIMEOUT_S)
