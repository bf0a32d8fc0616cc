"""A region as Serve applications (serve_app/regions/layout.py): every setting where a change of it
restarts only what it must, as Serve's own code decides (``serve_emulation.py``), and a config
that breaks the layout is found by the drift check."""

import copy
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from serve_app.auth.config import DEFAULT_TIERS
from serve_app.regions import layout
from serve_app.regions import schema as region_schema
from serve_app.regions import serve_config as region_serve_config
from serve_app.regions.cli import app as regions_app
from serve_app.router.call import LAST_ITEM_WAIT_S
from serve_emulation import IN_PLACE, RECONFIGURE, RESTART, SAME, deployments, what_a_redeploy_does
from tests.conftest import REPO, load_serve_config

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
MODEL, SIBLING = "qwen-3.6-35b-a3b", "qwen-3.5-27b"
ROUTER = ("llm", "Router")
QWEN = ("llm-qwen-3.6-35b-a3b", "model-qwen-3.6-35b-a3b")
SIBLING_MODEL = ("llm-qwen-3.5-27b", "model-qwen-3.5-27b")
EMBED = ("llm-qwen-3-embedding-0.6b", "model-qwen-3-embedding-0.6b")  # beside the LLM in every region


def _with(config: dict, change) -> dict:
    """``config`` after ``change(settings)`` of its region, laid out again (what render does)."""
    settings = layout.region_args(config)
    change(settings)
    changed = copy.deepcopy(config)
    changed["applications"] = layout.region_applications(settings)
    return changed


def _model(settings: dict, model_id: str = MODEL) -> dict:
    (entry,) = [m for m in settings["models"] if m["id"] == model_id]
    return entry


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_is_its_regions_settings_laid_out(name):
    config = load_serve_config(name)
    assert layout.problems(config) == []
    settings = layout.region_args(config)
    assert layout.region_applications(settings) == config["applications"]  # a round trip
    router, *models = config["applications"]
    assert set(router["args"]) <= set(layout.ROUTER_STARTUP)
    (options,) = router["deployments"]
    assert not set(options["user_config"]) & {"region", "telemetry"}
    assert not set(options["user_config"].get("router", {})) & {"num_cpus", "resources", *layout.ROUTER_OPTIONS}
    assert options["max_surge_percent"] == 100
    assert [m["name"] for m in models] == [layout.model_app_name("llm", m["id"]) for m in settings["models"]]
    for model in models:
        assert set(model["args"]["model"]) <= set(layout.MODEL_ENGINE)
        assert model["route_prefix"] is None and model["deployments"][0]["max_surge_percent"] == 100


ROUTER_ONLY = {
    "a tier's rate limit": lambda s: s["auth"].update(tiers={
        **{name: tier.model_dump() for name, tier in DEFAULT_TIERS.items()},
        "standard": {"requests_per_minute": 601, "tokens_per_minute": 1_000_000, "priority": 10},
    }),
    "the key cache's ttl": lambda s: s["auth"].update(cache_ttl_s=4),
    "a peer's timeout": lambda s: s.setdefault("failover", {}).update(connect_timeout_s=2.5),
    "the responses' retention": lambda s: s.update(responses={"retention_hours": 24}),
    "the ledger's flush": lambda s: s.update(usage={"flush_interval_s": 2}),
    "a model's default max_tokens": lambda s: _model(s).update(default_max_tokens=512),
}


@pytest.mark.parametrize("change", sorted(ROUTER_ONLY))
def test_a_router_setting_reconfigures_the_routers_in_place_and_leaves_the_models(change):
    """The measured outage of issue 23: a router-only edit restarted the model replicas."""
    config = load_serve_config("local.yaml")
    assert what_a_redeploy_does(config, _with(config, ROUTER_ONLY[change])) == {ROUTER: RECONFIGURE, QWEN: SAME, EMBED: SAME}


def test_whether_health_needs_a_model_reconfigures_the_routers_and_that_models_floor_in_place():
    """A required model's Serve floor is its min_replicas (a new cluster is not RUNNING before
    they are: layout.autoscaling_config), an optional one's 0: a deployment option, no restart."""
    config = load_serve_config("local.yaml")
    optional = _with(config, lambda s: _model(s).update(region_health="optional"))
    assert what_a_redeploy_does(config, optional) == {ROUTER: RECONFIGURE, QWEN: IN_PLACE, EMBED: SAME}


def test_what_a_router_reads_at_start_restarts_the_routers_only():
    """The tracer is installed once per process (serve_app/telemetry/tracing.py): a tracing
    change restarts the router replicas, new ones first; the models keep theirs."""
    config = load_serve_config("local.yaml")
    tracing = _with(config, lambda s: s.update(telemetry={"tracing": {"enabled": False, "sampling_ratio": 0.5}}))
    assert what_a_redeploy_does(config, tracing) == {ROUTER: RESTART, QWEN: SAME, EMBED: SAME}
    cpus = _with(config, lambda s: s["router"].update(num_cpus=0.2))
    assert what_a_redeploy_does(config, cpus) == {ROUTER: RESTART, QWEN: SAME, EMBED: SAME}
    placed = _with(config, lambda s: s["router"].update(resources={"region_credentials": 1}))
    assert what_a_redeploy_does(config, placed) == {ROUTER: RESTART, QWEN: SAME, EMBED: SAME}
    scaled = _with(config, lambda s: s["router"].update(num_replicas=2))
    assert what_a_redeploy_does(config, scaled) == {ROUTER: IN_PLACE, QWEN: SAME, EMBED: SAME}


def test_an_engine_flag_or_new_weights_restart_that_model_only():
    config = load_serve_config("fra-01.yaml")
    flag = _with(config, lambda s: _model(s)["engine"].update(max_num_seqs=48))
    assert what_a_redeploy_does(config, flag) == {ROUTER: RECONFIGURE, QWEN: RESTART, SIBLING_MODEL: SAME, EMBED: SAME}
    weights = _with(config, lambda s: _model(s)["engine"].update(source="Qwen/Qwen3.6-35B-A3B-FP8@rev2"))
    assert what_a_redeploy_does(config, weights) == {ROUTER: RECONFIGURE, QWEN: RESTART, SIBLING_MODEL: SAME, EMBED: SAME}
    gpus = _with(config, lambda s: _model(s)["resources"].update(num_cpus=6))
    assert what_a_redeploy_does(config, gpus) == {ROUTER: RECONFIGURE, QWEN: RESTART, SIBLING_MODEL: SAME, EMBED: SAME}


SERVE_KNOBS = {
    "max_queued_requests": lambda s: _model(s).update(max_queued_requests=129),
    "max_ongoing_requests": lambda s: _model(s).update(max_ongoing_requests=97),
    "max_replicas": lambda s: _model(s)["autoscaling"].update(max_replicas=4),
    "target_ongoing_requests": lambda s: _model(s)["autoscaling"].update(target_ongoing_requests=20),
    "graceful_shutdown_timeout_s": lambda s: _model(s).update(graceful_shutdown_timeout_s=900),
    "health_check_period_s": lambda s: _model(s).update(health_check_period_s=3),
}


@pytest.mark.parametrize("knob", sorted(SERVE_KNOBS))
def test_a_models_serve_knobs_restart_nothing(knob):
    config = load_serve_config("fra-01.yaml")
    done = what_a_redeploy_does(config, _with(config, SERVE_KNOBS[knob]))
    assert done[QWEN] in (IN_PLACE, RECONFIGURE) and done[SIBLING_MODEL] == SAME, done
    assert done[ROUTER] == RECONFIGURE  # its copy of the model's entry (its in-flight bounds)


def test_the_hot_load_policys_own_settings_restart_that_model_as_serve_2_60_hashes_them():
    """Serve hashes a deployment's autoscaling policy, kwargs included, into its application's
    code version (_private/deploy_utils.py:173-177): ours are min_replicas, initial_replicas,
    initial_state and the scaling delays. Pinned here so docs/operations.md stays true."""
    config = load_serve_config("fra-01.yaml")
    delay = _with(config, lambda s: _model(s)["autoscaling"].update(downscale_delay_s=900))
    assert what_a_redeploy_does(config, delay) == {ROUTER: RECONFIGURE, QWEN: RESTART, SIBLING_MODEL: SAME, EMBED: SAME}


def _rendered(region_id: str, change=None) -> dict:
    """The region's Serve config as `serve-app regions render` writes it, ``change`` made to its
    region file first (what an operator edits)."""
    data = yaml.safe_load((REPO / "regions" / f"{region_id}.yaml").read_text())
    if change is not None:
        change(data)
    return region_serve_config.serve_config(region_schema.parse_region(data, f"regions/{region_id}.yaml"))


def test_a_region_files_max_ongoing_requests_is_changed_in_place():
    """The render writes the routing threshold as the engine's batch (``saturated_at``), not as
    a share of ``max_ongoing_requests``: a share moved the routing options with it, which Serve
    hashes into the code version, so raising a region's ``max_ongoing_requests`` replaced every
    replica of the model (minutes each, a spare GPU each) where docs/operations.md says in place."""
    def raise_admission(data):
        (model,) = [m for m in data["models"] if m["id"] == MODEL]
        model["max_ongoing_requests"] = 128

    done = what_a_redeploy_does(_rendered("fra-01"), _rendered("fra-01", raise_admission))
    assert done[QWEN] in (IN_PLACE, RECONFIGURE) and done[SIBLING_MODEL] == SAME and done[EMBED] == SAME, done


def test_a_models_routing_options_restart_that_model_as_serve_2_60_hashes_them():
    """Serve hashes every deployment's ``request_router_config`` into its application's code
    version (_private/deploy_utils.py:168-194). Pinned here so docs/operations.md stays true."""
    config = load_serve_config("fra-01.yaml")
    wider = _with(config, lambda s: _model(s).setdefault("routing", {}).update(max_imbalance_fraction=0.5))
    assert what_a_redeploy_does(config, wider) == {ROUTER: RECONFIGURE, QWEN: RESTART, SIBLING_MODEL: SAME, EMBED: SAME}


def test_adding_a_model_starts_its_application_and_restarts_nothing():
    config = load_serve_config("yul-02.yaml")
    added = _with(config, lambda s: s["models"].append({**copy.deepcopy(_model(s)), "id": SIBLING}))
    assert [app["name"] for app in added["applications"]][-1] == SIBLING_MODEL[0]
    assert what_a_redeploy_does(config, added) == {ROUTER: RECONFIGURE, QWEN: SAME, EMBED: SAME}
    assert SIBLING_MODEL in deployments(added)


def test_every_deployment_surges_and_a_stopped_one_may_finish_any_request():
    for (_, name), options in deployments(load_serve_config("yul-02.yaml")).items():
        config = options.deployment_config
        if name == "ModelEntry":  # a model application's ingress: it never runs (serve_app/app.py)
            assert config.autoscaling_config.max_replicas == 1 and config.autoscaling_config.initial_replicas == 0
            continue
        assert config.max_surge_percent == 100  # replacements first, then the old ones stop
        assert config.graceful_shutdown_timeout_s >= 600  # the request timeout: no request lasts longer
        if name == "Router":  # behind HAProxy it admits requests for 30 s after its stop, then settles
            assert config.graceful_shutdown_timeout_s >= 600 + 30 + LAST_ITEM_WAIT_S


def test_a_router_stopped_behind_haproxy_outlasts_what_it_admits_in_its_reachable_window():
    """Serve keeps an ingress behind HAProxy reachable this long after its stop; a request admitted
    at the window's end may last the request timeout, then its last item and the ledger's write."""
    from ray.serve._private.constants import RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S

    from serve_app.config.model import REQUEST_TIMEOUT_S
    from serve_app.config.router import ROUTER_DRAIN_S, RouterArgs
    from serve_app.router.context import COUNT_WAIT_S, STORE_WAIT_S
    from serve_app.usage.ledger import CLOSE_WRITE_S

    assert RouterArgs().graceful_shutdown_timeout_s == ROUTER_DRAIN_S
    # ...what a request's settling may wait for after its end (wait_settled, in Ingress.__del__),
    # and the ledger's last write, bounded (then spooled), so that both end before Serve's kill.
    settling = max(LAST_ITEM_WAIT_S, STORE_WAIT_S, COUNT_WAIT_S)
    assert ROUTER_DRAIN_S > (REQUEST_TIMEOUT_S + RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S + settling
                             + CLOSE_WRITE_S)


# --- what the drift check finds -----------------------------------------------------------------
def test_a_router_setting_in_the_routers_args_is_found():
    config = load_serve_config("yul-02.yaml")
    router = config["applications"][0]
    router["args"]["auth"]["cache_ttl_s"] = 1  # would restart the routers, not reconfigure them
    (problem,) = layout.problems(config)
    assert problem.startswith("llm: args.auth.cache_ttl_s should not be here")


def test_a_model_application_out_of_step_with_the_routers_entry_is_found():
    config = load_serve_config("yul-02.yaml")
    config["applications"][1]["args"]["model"]["engine"]["max_num_seqs"] = 65  # edited in one place
    (problem,) = layout.problems(config)
    assert problem == "llm-qwen-3.6-35b-a3b: args.model.engine.max_num_seqs is 65; its region's settings render 64"


def test_a_model_application_no_router_lists_and_a_missing_one_are_found():
    config = load_serve_config("yul-02.yaml")
    model_app = config["applications"].pop(1)
    assert layout.problems(config) == ["llm-qwen-3.6-35b-a3b: missing; the llm router's settings list its model"]
    orphan = {**model_app, "name": "llm-qwen-3.5-27b"}
    config["applications"].append(model_app)
    config["applications"].append(orphan)
    assert layout.problems(config) == ["llm-qwen-3.5-27b: a model application no router's settings list"]


def test_a_router_setting_that_is_neither_read_at_start_nor_a_deployment_option_goes_to_user_config():
    """Router settings added later (a stall timeout, resume bounds) are applied in place unless
    listed as read at start: nothing of ``router`` may be dropped on the way."""
    written = {"region": "r", "router": {"num_cpus": 1, "num_replicas": 2, "stall_timeout_s": 30}, "models": []}
    startup, settings = layout.split_startup(written)
    assert startup == {"region": "r", "router": {"num_cpus": 1}}
    assert settings == {"router": {"stall_timeout_s": 30}, "models": []}
    assert layout.merge_settings(startup, settings)["router"] == {"num_cpus": 1, "stall_timeout_s": 30}


def test_a_setting_in_both_halves_is_refused():
    with pytest.raises(ValueError, match="auth.key_store_path: set in both"):
        layout.merge_settings({"auth": {"key_store_path": "/a"}}, {"auth": {"key_store_path": "/b"}})
    with pytest.raises(ValueError, match="region: set in both"):
        layout.merge_settings({"region": "a"}, {"region": "a"})


def test_the_drift_check_fails_on_a_config_that_breaks_the_layout(tmp_path):
    """Also a config no region file renders (one made by hand): its layout must hold."""
    for part in ("regions", "configs", "terraform"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=shutil.ignore_patterns(".terraform"))
    runner = CliRunner()
    assert runner.invoke(regions_app, ["check", "--repo", str(tmp_path)]).exit_code == 0
    hand = load_serve_config("local.yaml")
    hand["applications"][0]["args"]["auth"] = {"cache_ttl_s": 1}  # would restart the routers to change
    (tmp_path / "configs" / "by-hand.yaml").write_text(yaml.safe_dump(hand))
    result = runner.invoke(regions_app, ["check", "--repo", str(tmp_path)])
    assert result.exit_code == 1
    assert "configs/by-hand.yaml: llm: args.auth should not be here" in result.output


def test_the_layout_names_the_hot_load_policy_class():
    from ray._common.utils import import_attr

    from serve_app.hot_load.autoscaling import HotLoadPolicy

    assert import_attr(layout.POLICY_PATH) is HotLoadPolicy


def test_render_writes_the_local_config_from_its_source():
    from serve_app.regions.serve_config import render_local_serve_config

    text = render_local_serve_config((REPO / "regions" / "local" / "serve.yaml").read_text())
    assert text == (REPO / "configs" / "local.yaml").read_text()
    assert text.splitlines()[0].startswith("# GENERATED from regions/local/serve.yaml")
    assert CliRunner().invoke(regions_app, ["check"]).exit_code == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_deploys_with_haproxy_on_as_every_region_runs(name, monkeypatch):
    """Serve 2.60 refuses a custom request router on an application's ingress under HAProxy
    (application_state.override_deployment_info): the model deployments, which run ours, must not
    be their applications' ingress."""
    from ray.serve._private import application_state, build_app

    monkeypatch.setattr(application_state, "RAY_SERVE_ENABLE_HA_PROXY", True)
    monkeypatch.setattr(build_app, "RAY_SERVE_ENABLE_HA_PROXY", True)
    infos = deployments(load_serve_config(name))
    routed = [key for key, info in infos.items() if not info.deployment_config.request_router_config.is_default_request_router()]
    assert routed and not any(infos[key].ingress for key in routed)
