"""Two regions on one host, to try and measure failover without a second cluster.

``two_region_config`` turns the embedded CPU config (``configs/local.yaml``) into a Serve config
with two regions on the same port: ``local`` at ``/`` and ``peer`` at ``/peer``, each laid out as
a region is (its router's application ``llm`` or ``peer``, and one application per model, named
after it: serve_app/regions/layout.py). Each has its own router, rate limiter and model
deployments (the peer serves the chat model alone: it starts cold, on half a CPU, one request at
a time, so it is easy to overload), they share the signing keys and key store (as regions that
trust each other's tokens), and each names the other as its failover peer over 127.0.0.1. The
integration tests and ``python -m serve_app.bench.failover`` deploy it.
"""

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serve_app.auth.config import AuthArgs
from serve_app.regions.layout import ROUTER_APP, region_applications, region_args

PEER_APP, PEER_REGION, PEER_PREFIX = "peer", "peer", "/peer"
LOCAL_PREFIX = "/"


def two_region_config(
    local_config: dict[str, Any], port: int, auth_dir: Path, *, adjust: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """``local_config`` (one region) on ``port``, with auth files in ``auth_dir``, plus the peer.
    ``adjust(settings)``, when given, changes each region's settings (``AppArgs``, as written;
    ``settings["region"]`` says which) before they are laid out as applications."""
    config = copy.deepcopy(local_config)
    config["http_options"]["port"] = port
    local, peer = two_region_args(region_args(config), f"http://127.0.0.1:{port}", auth_dir)
    for settings in (local, peer):
        if adjust is not None:
            adjust(settings)
    config["applications"] = [
        *region_applications(local, name=ROUTER_APP, route_prefix=LOCAL_PREFIX),
        *region_applications(peer, name=PEER_APP, route_prefix=PEER_PREFIX),
    ]
    return config


def two_region_args(local_args: dict[str, Any], base_url: str, auth_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The local region's settings with auth files in ``auth_dir`` and the peer as its failover
    peer, and the peer's (``peer_args``)."""
    local = copy.deepcopy(local_args)
    local["auth"] = {
        **local.get("auth", {}),
        "key_store_path": str(auth_dir / "keys.sqlite3"),
        "signing_keys_path": str(auth_dir / "signing-keys.json"),
    }
    local["failover"] = {"peers": [{"region": PEER_REGION, "endpoint": base_url + PEER_PREFIX}]}
    return local, peer_args(local, base_url)


def peer_args(local: dict[str, Any], base_url: str) -> dict[str, Any]:
    """The ``peer`` region: a copy of the local region's settings with its own region id."""
    peer = copy.deepcopy(local)
    peer["region"] = PEER_REGION
    peer.setdefault("router", {})["num_replicas"] = 1
    peer["auth"].pop("dev_api_key_env", None)  # only the local region may have a dev key
    peer["failover"] = {"peers": [{"region": "local", "endpoint": base_url}]}
    # The chat model only: a second embedding engine would not fit the host's 2 CPUs beside the
    # local region's replicas (configs/local.yaml).
    model = peer["models"][0]
    peer["models"] = [model]
    model["initial_state"] = "cold"
    model.pop("region_health", None)  # a cold model cannot hold /health up; the tests load it
    model["resources"]["num_cpus"] = 0.5  # with the local replica, its upgrade's and the routers: 2 CPUs
    model["max_ongoing_requests"], model["max_queued_requests"] = 1, 1  # easy to overload
    return peer


def create_key_material(auth: AuthArgs) -> None:
    """What an operator provisions before a region starts (only ``local`` creates its own)."""
    from serve_app.auth.keys import KeyStore
    from serve_app.auth.tokens import KeysetFile

    KeyStore(auth.key_store(), create=True)
    KeysetFile(auth.signing_keys(), create=True)
