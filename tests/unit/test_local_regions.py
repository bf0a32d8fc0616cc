"""The two-regions-on-one-host config the integration tests and the failover benchmark deploy."""

from pathlib import Path

from ray.serve.schema import ServeDeploySchema

from serve_app.config import parse_app_args
from serve_app.devtools.local_regions import two_region_config
from tests.conftest import load_serve_config


def test_two_regions_share_keys_name_each_other_and_the_peer_starts_cold(tmp_path: Path):
    config = two_region_config(load_serve_config("local.yaml"), 8123, tmp_path)
    ServeDeploySchema.model_validate(config)  # Ray accepts it as one `serve deploy` file
    local, peer = (parse_app_args(app["args"]) for app in config["applications"])
    assert [app["route_prefix"] for app in config["applications"]] == ["/", "/peer"]
    assert (local.region, peer.region) == ("local", "peer")
    assert [(p.region, p.endpoint) for p in local.failover.peers] == [("peer", "http://127.0.0.1:8123/peer")]
    assert [(p.region, p.endpoint) for p in peer.failover.peers] == [("local", "http://127.0.0.1:8123")]
    assert local.auth.key_store_path == peer.auth.key_store_path == str(tmp_path / "keys.sqlite3")
    assert local.auth.signing_keys_path == peer.auth.signing_keys_path
    assert peer.auth.dev_api_key_env is None  # a dev key is for the local region only
    assert (local.models[0].initial_state, peer.models[0].initial_state) == ("loaded", "cold")
    # Fits a 2-CPU host beside the local replica once loaded.
    total = sum(m.resources.num_cpus for a in (local, peer) for m in a.models)
    total += local.router.num_cpus * local.router.num_replicas + peer.router.num_cpus * peer.router.num_replicas
    assert total <= 2
