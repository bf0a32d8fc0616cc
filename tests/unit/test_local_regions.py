"""The two-regions-on-one-host config the integration tests and the failover benchmark deploy."""

from pathlib import Path

from ray.serve.schema import ServeDeploySchema

from serve_app.devtools.local_regions import PEER_APP, two_region_config
from serve_app.regions import layout
from tests.conftest import load_serve_config


def test_two_regions_share_keys_name_each_other_and_the_peer_starts_cold(tmp_path: Path):
    config = two_region_config(load_serve_config("local.yaml"), 8123, tmp_path)
    ServeDeploySchema.model_validate(config)  # Ray accepts it as one `serve deploy` file
    assert layout.problems(config) == []  # each region laid out as a region is
    names = [app["name"] for app in config["applications"]]
    # The peer serves the chat model alone (an embedding engine more would not fit 2 CPUs).
    assert names == ["llm", "llm-qwen-3.6-35b-a3b", "llm-qwen-3-embedding-0.6b", "peer", "peer-qwen-3.6-35b-a3b"]
    assert [app["route_prefix"] for app in config["applications"]] == ["/", None, None, "/peer", None]
    local, peer = layout.parse_region(config, "llm"), layout.parse_region(config, PEER_APP)
    assert (local.region, peer.region) == ("local", "peer")
    assert [(p.region, p.endpoint) for p in local.failover.peers] == [("peer", "http://127.0.0.1:8123/peer")]
    assert [(p.region, p.endpoint) for p in peer.failover.peers] == [("local", "http://127.0.0.1:8123")]
    assert local.auth.key_store_path == peer.auth.key_store_path == str(tmp_path / "keys.sqlite3")
    assert local.auth.signing_keys_path == peer.auth.signing_keys_path
    assert peer.auth.dev_api_key_env is None  # a dev key is for the local region only
    assert (local.models[0].initial_state, peer.models[0].initial_state) == ("loaded", "cold")
    # Fits a 2-CPU host with the peer's model loaded and the local one being upgraded (its
    # replacement starts beside it: serve_app/regions/layout.py, SURGE_PERCENT).
    total = sum(m.resources.num_cpus for a in (local, peer) for m in a.models) + local.models[0].resources.num_cpus
    total += local.router.num_cpus * local.router.num_replicas + peer.router.num_cpus * peer.router.num_replicas
    assert total <= 2


def test_adjust_changes_each_regions_settings_before_they_are_laid_out(tmp_path: Path):
    def two_local_routers(settings):
        if settings["region"] == "local":
            settings["router"]["num_replicas"] = 2
        settings["auth"]["cache_ttl_s"] = 1

    config = two_region_config(load_serve_config("local.yaml"), 8123, tmp_path, adjust=two_local_routers)
    routers = {app["name"]: layout.router_deployment(app) for app in layout.router_applications(config)}
    assert (routers["llm"]["num_replicas"], routers["peer"]["num_replicas"]) == (2, 1)
    assert routers["llm"]["user_config"]["auth"]["cache_ttl_s"] == routers["peer"]["user_config"]["auth"]["cache_ttl_s"] == 1
    assert layout.problems(config) == []
