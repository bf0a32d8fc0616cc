import pytest

from router_app import build_router_app, close_open_routers, close_router_app
from serve_app.runtime.cpus import GATEWAY_CPUS_ENV


@pytest.fixture
def router_app(tmp_path, monkeypatch):
    """``router_app(**options)``: the real router on a fake engine (``router_app.py``); each call
    builds one more (two regions, say), all closed when the test ends."""
    built = []

    def build(**options):
        app = build_router_app(tmp_path / f"router-{len(built)}", monkeypatch, **options)
        built.append(app)
        return app

    yield build
    for app in built:
        close_router_app(app)


@pytest.fixture
def stream_loopback(monkeypatch):
    """Model replicas made in the test listen for routers on 127.0.0.1, not the node's address."""
    monkeypatch.setenv("SERVE_APP_STREAM_HOST", "127.0.0.1")


@pytest.fixture(autouse=True)
def _close_router_clients():
    """Routers a test opened with ``router_app.router_client`` end with the test."""
    yield
    close_open_routers()


@pytest.fixture(autouse=True)
def _stay_unpinned(monkeypatch):
    """A router or model replica a unit test builds in this process must not pin the test run to
    the gateway's CPUs (the integration session exports SERVE_APP_GATEWAY_CPUS for its cluster)."""
    monkeypatch.delenv(GATEWAY_CPUS_ENV, raising=False)
