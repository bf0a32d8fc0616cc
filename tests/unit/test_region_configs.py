"""GPU region configs cannot run here; their production settings are checked instead."""

import json
from pathlib import Path

import pytest
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from serve_app import catalog
from serve_app.app import model_actor_options
from serve_app.config import parse_app_args
from serve_app.regions.layout import POLICY_PATH, model_app_name, model_serve_options
from tests.conftest import REPO, app_args, load_serve_config

BLACKWELL = {"B200", "B300", "GB200", "GB300", "RTX-PRO-6000"}
GPU_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml") if not p.name.startswith("local"))


def test_there_is_at_least_one_gpu_region():
    assert GPU_CONFIGS


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_region_config_runs_the_production_checkpoint_on_a_blackwell_gpu(name):
    config = load_serve_config(name)
    args = parse_app_args(app_args(config))
    assert args.region == Path(name).stem
    deployed = {app["name"]: app for app in config["applications"]}
    for model in args.models:
        entry = catalog.get(model.id)
        (options,) = deployed[model_app_name("llm", model.id)]["deployments"]  # what Serve applies
        assert options == model_serve_options(model)
        actor = model_actor_options(model)
        assert 0 < actor["num_gpus"] <= 1  # a GPU, or a share of one
        assert actor["accelerator_type"] in BLACKWELL
        assert model.engine.source is None, "regions serve the catalog's checkpoint"
        flags = make_arg_parser(FlexibleArgumentParser()).parse_args(
            model.engine_cli_args(entry.hf_repo)
        )
        assert flags.model == entry.hf_repo
        assert flags.quantization is None  # the checkpoint's own weights, no runtime requantization
        assert flags.max_model_len == 8192
        assert flags.enforce_eager is True
        if entry.task == "generate":
            assert flags.model.endswith("-FP8")
            assert flags.default_chat_template_kwargs == {"enable_thinking": False}
        else:
            assert flags.runner == "pooling" and flags.hf_overrides == {"is_matryoshka": True}
        scaling = options["autoscaling_config"]
        # Serve's floor is 0 (a model can be unloaded; the hot-load policy keeps a loaded one up),
        # but a model the region's health requires starts its floor's replicas with the
        # application: a new cluster is not RUNNING (nor given traffic by KubeRay) before they are.
        loaded_floor = scaling["policy"]["policy_kwargs"]["min_replicas"]
        assert scaling["min_replicas"] == (loaded_floor if model.region_health == "required" else 0)
        assert scaling["policy"]["policy_function"] == POLICY_PATH
        assert 1 <= loaded_floor <= scaling["max_replicas"]
        assert "initial_replicas" not in scaling  # Serve would reset the target to it on every change
        assert loaded_floor <= scaling["policy"]["policy_kwargs"]["initial_replicas"] <= scaling["max_replicas"]
        assert scaling["target_ongoing_requests"] <= options["max_ongoing_requests"]
        assert options["max_queued_requests"] > 0
        if flags.max_num_seqs is not None:
            # The engine keeps a queue of its own: Serve's re-polls for a free slot (docs/architecture.md).
            assert options["max_ongoing_requests"] > flags.max_num_seqs
            # ...and a replica keeps its affinity requests until its batch is full, not before
            # (at 0.5 of 96, a region's replica shed them at 48 in flight with 16 of 64 seats free),
            # counted in requests, so that max_ongoing_requests stays an in-place knob.
            kwargs = options["request_router_config"]["request_router_kwargs"]
            assert kwargs["saturated_at"] == flags.max_num_seqs and "saturated_fraction" not in kwargs


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_every_region_exports_traces_to_its_collector_with_a_consistent_protocol(name):
    from serve_app.regions.schema import load_region

    config = load_serve_config(name)
    tracing = parse_app_args(app_args(config)).telemetry.tracing
    region = load_region(REPO / "regions" / name)
    assert tracing.enabled
    assert tracing.endpoint.startswith(region.otlp_endpoint)
    port = region.otlp_endpoint.rsplit(":", 1)[-1]
    assert (tracing.protocol, port) in {("grpc", "4317"), ("http/protobuf", "4318")}
    if tracing.protocol == "http/protobuf":
        assert tracing.endpoint.endswith("/v1/traces")
    assert 0 < tracing.sampling_ratio <= 1
    assert tracing.resource_attributes["deployment.environment"] == region.status


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_routers_read_the_nearest_registry_instance_and_write_the_primary(name):
    """The Serve config reads both DSNs from the env vars the region's Terraform fills from the
    registry Secret's `dsn` and `read_dsn`; an empty `read_dsn` sends reads to the primary."""
    import hcl2

    region_id = Path(name).stem
    auth = parse_app_args(app_args(load_serve_config(name))).auth
    root = REPO / "terraform" / "regions" / region_id
    (call,) = [body for entry in hcl2.loads((root / "main.tf").read_text())["module"] for body in entry.values()]
    tfvars = json.loads((root / "generated.auto.tfvars.json").read_text())
    assert call["registry_dsn_env"].strip('"') == auth.key_registry_dsn_env
    assert call["registry_read_dsn_env"] == "${var.registry_read_dsn_env}"
    assert tfvars["registry_read_dsn_env"] == auth.key_registry_read_dsn_env
    module = REPO / "terraform" / "modules" / "region"
    (env,) = [entry["registry_env"] for entry in hcl2.loads((module / "rayservice.tf").read_text())["locals"]
              if "registry_env" in entry]
    from_secret = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"].strip('"') for e in env if "valueFrom" in e}
    assert from_secret == {"${var.registry_dsn_env}": "dsn", "${var.registry_read_dsn_env}": "read_dsn"}

    # Both DSNs' sslrootcert (docs/regions.md) is where the module mounts the registry's CA bundle.
    (volume,) = [v for v in hcl2.loads((module / "rayservice.tf").read_text())["locals"][0]["auth_mounts"]
                 if v["name"] == '"registry-ca"']
    assert volume == {"name": '"registry-ca"', "mountPath": "${var.auth_mounts.registry_ca_dir}", "readOnly": True}
    ca_file = f"{tfvars['auth_mounts']['registry_ca_dir']}/{tfvars['auth_mounts']['registry_ca_file']}"
    assert f"sslrootcert={ca_file}" in (REPO / "docs" / "regions.md").read_text()

    primary, replica = "postgresql://app@primary/registry", "postgresql://app@replica/registry"
    environ = {auth.key_registry_dsn_env: primary, auth.key_registry_read_dsn_env: replica}
    assert auth.key_store(environ) == primary
    assert auth.key_store_replica(environ) == replica
    assert auth.key_store_replica({**environ, auth.key_registry_read_dsn_env: ""}) is None
