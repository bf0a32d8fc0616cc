"""Two regions on one host, to try and measure failover without a second cluster.

``two_region_config`` turns the embedded CPU config (``configs/local.yaml``) into a Serve config
with two applications on the same port: ``local`` at ``/`` and ``peer`` at ``/peer``. Each has its
own router, rate limiter and model deployments (the peer serves the chat model alone: it starts
cold, on half a CPU, one request at a time, so it is easy to overload), they share the signing keys and key store (as
regions that trust each other's tokens), and each names the other as its failover peer over
127.0.0.1. The integration tests and ``python -m serve_app.bench.failover`` deploy it.
"""

import copy
from pathlib import Path
from typing import Any

from serve_app.auth.config import AuthArgs

PEER_APP, PEER_REGION, PEER_PREFIX = "peer", "peer", "/peer"


def two_region_config(local_config: dict[str, Any], port: int, auth_dir: Path) -> dict[str, Any]:
    """``local_config`` (one application) on ``port``, with auth files in ``auth_dir``, plus the peer."""
    config = copy.deepcopy(local_config)
    config["http_options"]["port"] = port
    (local,) = config["applications"]
    base_url = f"http://127.0.0.1:{port}"
    args = local["args"]
    args["auth"] = {
        **args["auth"],
        "key_store_path": str(auth_dir / "keys.sqlite3"),
        "signing_keys_path": str(auth_dir / "signing-keys.json"),
    }
    args["failover"] = {"peers": [{"region": PEER_REGION, "endpoint": base_url + PEER_PREFIX}]}
    config["applications"].append(peer_application(local, base_url))
    return config


def peer_application(local: dict[str, Any], base_url: str) -> dict[str, Any]:
    """The ``peer`` region: a copy of the local application with its own name, prefix and region."""
    peer = copy.deepcopy(local)
    peer["name"], peer["route_prefix"] = PEER_APP, PEER_PREFIX
    args = peer["args"]
    args["region"] = PEER_REGION
    args["router"]["num_replicas"] = 1
    args["auth"].pop("dev_api_key_env", None)  # only the local region may have a dev key
    args["failover"] = {"peers": [{"region": "local", "endpoint": base_url}]}
    # The chat model only: a second embedding engine would not fit the host's 2 CPUs beside the
    # local region's replicas (configs/local.yaml).
    model = args["models"][0]
    args["models"] = [model]
    model["initial_state"] = "cold"
    model["resources"]["num_cpus"] = 0.5  # with the local replica (1) and the routers: under 2 CPUs
    model["max_ongoing_requests"], model["max_queued_requests"] = 1, 1  # easy to overload
    return peer


def create_key_material(auth: AuthArgs) -> None:
    """What an operator provisions before a region starts (only ``local`` creates its own)."""
    from serve_app.auth.keys import KeyStore
    from serve_app.auth.tokens import KeysetFile

    KeyStore(auth.key_store(), create=True)
    KeysetFile(auth.signing_keys(), create=True)
