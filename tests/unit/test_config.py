import json

import pytest
from pydantic import ValidationError
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from serve_app.app import ROUTER_PROCESS_ENV, model_actor_options, router_actor_options
from serve_app.regions.layout import model_serve_options
from serve_app.config import AppArgs, ModelDeploymentArgs, parse_app_args
from tests.conftest import app_args, load_serve_config


def minimal(**model):
    return {"models": [{"id": "qwen-3.6-35b-a3b", **model}]}


def test_defaults_are_explicit_autoscaling_numbers():
    args = AppArgs.model_validate(minimal())
    model = args.models[0]
    assert model.autoscaling.target_ongoing_requests > 0
    assert model.max_ongoing_requests >= model.autoscaling.target_ongoing_requests
    assert model.max_queued_requests >= 0
    assert args.router.num_cpus < 1


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"models": [], "region": "x"}, "models"),
        ({"modles": []}, "modles"),
        (minimal(enigne={}), "models.0.enigne"),
        (minimal(engine={"max_model_length": 10}), "models.0.engine.max_model_length"),
        ({"models": [{"id": "gpt-4o"}]}, "not a canonical catalog id"),
        ({"models": [{"id": "qwen-3.6-a3b"}]}, "not a canonical catalog id"),
        (minimal(autoscaling={"min_replicas": 3, "max_replicas": 2}), "min_replicas (3) > max_replicas (2)"),
        (
            minimal(autoscaling={"min_replicas": 1, "initial_replicas": 5, "max_replicas": 2}),
            "models.0.autoscaling: initial_replicas (5) is not within [min_replicas 1, max_replicas 2]",
        ),
        (minimal(resources={"accelerator_type": "B200"}), "num_gpus is 0"),
        (minimal(resources={"num_gpus": 2}), "num_gpus"),
        ({"models": [{"id": "qwen-3.6-35b-a3b"}, {"id": "qwen-3.6-35b-a3b"}]}, "listed twice"),
        (minimal(autoscaling={"min_replicas": 0}), "models.0.autoscaling.min_replicas"),  # cold instead
        (minimal(max_queued_requests=0), "max_queued_requests"),  # Serve: -1 or >= 1
        (minimal(initial_state="warm"), "initial_state"),
        (minimal(default_max_tokens=8193), "default_max_tokens (8193) is over the served max_model_len (8192)"),
        (minimal(engine={"max_model_len": 2048}, default_max_tokens=4096), "over the served max_model_len (2048)"),
        (minimal(default_max_tokens=0), "models.0.default_max_tokens"),
        # Forwarded requests carry the caller's credential: TLS unless it never leaves the host.
        ({**minimal(), "failover": {"peers": [{"region": "b", "endpoint": "http://api.b.example"}]}}, "https"),
        ({**minimal(), "failover": {"peers": [{"region": "b", "endpoint": "ftp://b"}]}}, "https"),
        ({**minimal(), "failover": {"peers": [{"region": "local", "endpoint": "https://a"}]}}, "itself"),
        (
            {**minimal(), "failover": {"peers": [{"region": "b", "endpoint": "https://b"}] * 2}},
            "listed twice",
        ),
    ],
)
def test_bad_args_are_rejected_with_a_message_naming_the_problem(raw, fragment):
    with pytest.raises(ValueError) as err:
        parse_app_args(raw)
    assert fragment in str(err.value)


def test_the_default_completion_limit_is_the_catalogs_or_the_deployments_within_its_context():
    assert ModelDeploymentArgs(id="qwen-3.6-35b-a3b").completion_default == 4096
    assert ModelDeploymentArgs(id="qwen-3.6-35b-a3b", default_max_tokens=512).completion_default == 512
    smaller = ModelDeploymentArgs(id="qwen-3.6-35b-a3b", engine={"max_model_len": 2048})
    assert (smaller.max_model_len, smaller.completion_default) == (2048, 2048)


def test_every_problem_is_one_line_naming_its_path_without_pydantics_prefix():
    with pytest.raises(ValueError) as err:
        parse_app_args({"models": [{"id": "gpt-4o"}], "modles": []})
    first, *problems = str(err.value).splitlines()
    assert first == "invalid application args:"
    assert sorted(problems) == [
        "  models.0.id: 'gpt-4o' is not a canonical catalog id (known: qwen-3.6-35b-a3b, qwen-3.5-27b, "
        "qwen-3-embedding-0.6b)",
        "  modles: Extra inputs are not permitted",
    ]


def test_peers_may_use_plain_http_only_on_loopback():
    for endpoint in ("https://api.b.example/", "http://127.0.0.1:8000/peer", "http://localhost:8000"):
        args = parse_app_args({**minimal(), "failover": {"peers": [{"region": "b", "endpoint": endpoint}]}})
        assert args.failover.peers[0].endpoint == endpoint.rstrip("/")


def test_engine_flags_start_from_the_catalog_and_take_overrides():
    model = ModelDeploymentArgs(
        id="qwen-3.6-35b-a3b",
        engine={"tool_call_parser": "hermes", "max_num_seqs": 4, "extra_args": {"seed": 7}},
    )
    flags = model.engine_cli_args("/models/tiny")
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(flags)
    assert parsed.model == "/models/tiny"
    assert parsed.served_model_name == ["qwen-3.6-35b-a3b"]
    assert parsed.max_model_len == 8192
    assert parsed.enforce_eager is True
    assert parsed.tool_call_parser == "hermes"
    assert parsed.enable_auto_tool_choice is True
    assert parsed.enable_prompt_tokens_details is True  # cached tokens in every route's usage
    assert parsed.reasoning_parser == "qwen3"
    assert parsed.max_num_seqs == 4
    assert parsed.seed == 7
    assert parsed.default_chat_template_kwargs == {"enable_thinking": False}


def test_a_router_replica_asks_ray_for_its_cpus_and_the_resources_its_args_name():
    """A region's routers ask for the resource only its head offers (test_terraform_network.py);
    a local config names none, so a plain `ray start` places them."""
    local = router_actor_options({"router": {"num_cpus": 0.1}})
    assert local == {"num_cpus": 0.1, "runtime_env": {"env_vars": ROUTER_PROCESS_ENV}}
    region = router_actor_options({"router": {"num_cpus": 1, "resources": {"region_credentials": 1}}})
    assert region == local | {"num_cpus": 1, "resources": {"region_credentials": 1}}
    with pytest.raises(ValidationError, match="greater than 0"):
        router_actor_options({"router": {"resources": {"region_credentials": 0}}})  # asks for nothing


def test_deployment_options_carry_autoscaling_queue_bounds_and_resources():
    model = ModelDeploymentArgs(
        id="qwen-3.6-35b-a3b",
        autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 12},
        max_ongoing_requests=40,
        max_queued_requests=80,
        resources={"num_cpus": 4, "num_gpus": 1, "accelerator_type": "B200", "env": {"A": "1"}},
    )
    options = model_serve_options(model)
    assert options["name"] == "model-qwen-3.6-35b-a3b"
    assert options["autoscaling_config"]["target_ongoing_requests"] == 12
    assert options["autoscaling_config"]["max_replicas"] == 3
    assert options["max_ongoing_requests"] == 40
    assert options["max_queued_requests"] == 80
    # A dead engine fails its health check at once; Serve replaces it after 3 in a row.
    assert options["health_check_period_s"] == 2
    assert options["health_check_timeout_s"] == 30
    assert model_actor_options(model) == {
        "num_cpus": 4,
        "num_gpus": 1,
        "accelerator_type": "B200",
        "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "A": "1",
                                     "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}},
    }


def test_a_model_replica_runs_its_code_on_serves_loop_unless_the_config_says_otherwise():
    default = ModelDeploymentArgs(id="qwen-3.6-35b-a3b")
    assert model_actor_options(default)["runtime_env"]["env_vars"]["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    separate = ModelDeploymentArgs(id="qwen-3.6-35b-a3b",
                                   resources={"env": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}})
    assert model_actor_options(separate)["runtime_env"]["env_vars"]["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"


def test_the_agent_workloads_local_config_runs_two_cached_replicas_compared_with_default_routing():
    """configs/local-agent.yaml (``serve-app bench-agent``): two replicas with prefix caching on,
    both routing arms on one deployment, and room on 2 CPUs for an upgrade's two replacements."""
    config = load_serve_config("local-agent.yaml")
    args = parse_app_args(app_args(config))
    (model,) = args.models
    assert (model.autoscaling.min_replicas, model.autoscaling.max_replicas) == (2, 2)
    assert model.engine.extra_args["enable-prefix-caching"] is True
    assert model.routing.policy == "prefix_affinity" and model.routing.compare_with_default
    assert args.router.num_cpus + 2 * 2 * model.resources.num_cpus <= 2


def test_the_benchmarks_local_config_is_the_local_chat_model_alone_with_the_same_settings():
    """configs/local-bench.yaml (``serve-app bench``): one engine, as bare vLLM runs, and exactly
    configs/local.yaml's chat model and router, so a figure measured on it holds for ``make run``."""
    bench = parse_app_args(app_args(load_serve_config("local-bench.yaml")))
    local = parse_app_args(app_args(load_serve_config("local.yaml")))
    assert [model.id for model in bench.models] == ["qwen-3.6-35b-a3b"]
    assert bench.models[0] == local.models[0] and bench.router == local.router and bench.auth == local.auth


def test_local_config_serves_the_tiny_models_on_cpu_under_the_canonical_ids():
    config = load_serve_config("local.yaml")
    assert config["http_options"]["host"] == "127.0.0.1"
    assert config["http_options"]["port"] == 8000
    args = parse_app_args(app_args(config))
    assert [model.id for model in args.models] == ["qwen-3.6-35b-a3b", "qwen-3-embedding-0.6b"]
    for model in args.models:
        assert model.engine.source == "tiny-local"
        actor = model_actor_options(model)
        assert "num_gpus" not in actor
        assert actor["runtime_env"]["env_vars"]["VLLM_CPU_KVCACHE_SPACE"]
        json.dumps([actor, model_serve_options(model)])  # plain data: Serve ships it to the controller
    # The router and both model replicas fit on a 2-CPU machine, and so do the models'
    # replacements while an upgrade starts them beside the old ones (serve_app/regions/layout.py,
    # SURGE_PERCENT).
    assert args.router.num_cpus + 2 * sum(model.resources.num_cpus for model in args.models) <= 2


def test_the_embedding_model_runs_on_vllms_pooling_runner_without_the_chat_flags():
    flags = ModelDeploymentArgs(id="qwen-3-embedding-0.6b").engine_cli_args("/weights")
    assert flags[flags.index("--runner") + 1] == "pooling"
    assert json.loads(flags[flags.index("--hf-overrides") + 1]) == {"is_matryoshka": True}
    assert not {"--default-chat-template-kwargs", "--enable-auto-tool-choice", "--no-enable-auto-tool-choice"} & set(flags)
    assert "--enable-per-request-metrics" in flags
    # The chat model's flags are as they were: the template switch and tool choice.
    chat = ModelDeploymentArgs(id="qwen-3.6-35b-a3b").engine_cli_args("/weights")
    assert chat[chat.index("--default-chat-template-kwargs") + 1] == '{"enable_thinking": false}'
    assert "--enable-auto-tool-choice" in chat and "--runner" not in chat


def test_an_embedding_model_has_no_completion_limit_to_set():
    assert ModelDeploymentArgs(id="qwen-3-embedding-0.6b").completion_default is None
    with pytest.raises(ValueError, match="generates nothing"):
        ModelDeploymentArgs(id="qwen-3-embedding-0.6b", default_max_tokens=16)


def test_a_replica_may_ask_for_a_fraction_of_a_gpu():
    model = ModelDeploymentArgs(id="qwen-3-embedding-0.6b", resources={"num_gpus": 0.1, "accelerator_type": "B200"})
    assert model_actor_options(model)["num_gpus"] == 0.1
    with pytest.raises(ValueError):
        ModelDeploymentArgs(id="qwen-3-embedding-0.6b", resources={"num_gpus": 1.5})


def test_a_replica_env_cannot_move_the_stop_limit_the_router_checks():
    """The router refuses a fifth stop sequence itself, before charging (router/strict.py): a
    region raising vLLM's limit on its replicas would see its clients refused all the same."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="VLLM_MAX_STOP_STRINGS"):
        ModelDeploymentArgs(id="qwen-3.6-35b-a3b", resources={"env": {"VLLM_MAX_STOP_STRINGS": "8"}})
    assert ModelDeploymentArgs(id="qwen-3.6-35b-a3b", resources={"env": {"OMP_NUM_THREADS": "2"}})
