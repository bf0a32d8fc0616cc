"""`serve-app gpu-smoke` without a GPU: the flags it derives from each region config (the GPU
path's engine settings), the one-GPU app it would start, its arguments, and its checks on fake
torch and canned OpenAI responses."""

import json
from types import SimpleNamespace

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from typer.testing import CliRunner
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from serve_app import catalog
from serve_app.image import gpu_smoke
from serve_app.image import gpu_smoke_checks as checks
from serve_app.cli import app as cli_app
from serve_app.config import parse_app_args
from serve_app.regions.schema import load_regions
from serve_app.surfaces import CHAT
from serve_app.surfaces.dialects import pg_metadata_event

ROUTE_CHAT = CHAT.route
from tests.conftest import REPO

REGIONS = load_regions(REPO / "regions")
MODEL = "qwen-3.6-35b-a3b"


def parsed(flags: list[str]):
    return make_arg_parser(FlexibleArgumentParser()).parse_args(flags)


# --- the flags of the GPU path, per region ------------------------------------------------------


@pytest.mark.parametrize("region_id", sorted(REGIONS))
def test_derived_flags_carry_the_catalogs_gpu_settings_and_the_regions_knobs(region_id):
    args = gpu_smoke.load_region_args(region_id)
    for wanted in REGIONS[region_id].models:
        entry = catalog.get(wanted.id)
        flags = parsed(gpu_smoke.engine_flags(args, wanted.id))
        assert flags.gpu_memory_utilization == wanted.gpu_memory_utilization
        if entry.task == "embed":  # beside the LLM on its GPU: the pooling runner, its own budget
            assert (flags.model, flags.runner, flags.max_num_seqs) == (entry.hf_repo, "pooling", wanted.max_num_seqs)
            assert flags.max_num_batched_tokens == wanted.max_num_batched_tokens
            continue
        assert flags.model == entry.hf_repo and flags.model.endswith("-FP8")
        assert flags.quantization is None  # the checkpoint's own FP8 quantization_config
        assert (flags.max_model_len, flags.enforce_eager) == (8192, True)
        assert (flags.tool_call_parser, flags.reasoning_parser) == ("qwen3_coder", "qwen3")
        assert flags.enable_auto_tool_choice is True and flags.tool_strict_level == "parameter"
        assert flags.gpu_memory_utilization == wanted.gpu_memory_utilization
        assert flags.max_num_seqs == wanted.max_num_seqs
        assert flags.speculative_config is None  # MTP is opt-in and no region has it on


def test_the_production_models_offer_mtp_and_vllm_knows_the_method():
    from typing import get_args

    from vllm.config.speculative import MTPModelTypes

    assert {m.speculative_method for m in catalog.CATALOG.values() if m.task == "generate"} == {"mtp"}
    assert "mtp" in get_args(MTPModelTypes)
    assert catalog.speculative_config(catalog.get(MODEL), 2) == {"method": "mtp", "num_speculative_tokens": 2}


def test_a_region_that_opts_into_mtp_renders_vllms_speculative_config():
    import yaml

    from serve_app.regions import schema as regions
    from serve_app.regions import serve_config as region_config

    data = yaml.safe_load((REPO / "regions" / "yul-02.yaml").read_text())
    data["models"][0]["speculative_decoding"] = {"method": "mtp", "num_speculative_tokens": 2}
    args = region_config.app_args(regions.parse_region(data))
    assert args["models"][0]["engine"]["extra_args"] == {
        "speculative-config": '{"method": "mtp", "num_speculative_tokens": 2}'
    }
    flags = parsed(gpu_smoke.engine_flags(args))
    assert flags.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert (flags.max_model_len, flags.enforce_eager, flags.quantization) == (8192, True, None)


@pytest.mark.parametrize(
    ("setting", "fragment"),
    [
        ({"method": "eagle"}, "speculative_decoding.method"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "greater than or equal to 1"),
        ({"num_speculative_tokens": 1}, "speculative_decoding.method: Field required"),
    ],
)
def test_bad_speculative_settings_are_refused(setting, fragment):
    import yaml

    from serve_app.regions import schema as regions

    data = yaml.safe_load((REPO / "regions" / "yul-02.yaml").read_text())
    data["models"][0]["speculative_decoding"] = setting
    with pytest.raises(regions.RegionError, match=fragment):
        regions.parse_region(data, "regions/yul-02.yaml")


def test_a_model_without_a_speculative_method_cannot_opt_in(monkeypatch):
    from serve_app.regions import schema as regions

    plain = catalog.get(MODEL).model_copy(update={"speculative_method": None})
    monkeypatch.setitem(catalog.CATALOG, MODEL, plain)
    with pytest.raises(ValueError, match="offers no speculative method"):
        regions.RegionModel(id=MODEL, replicas={"min": 1, "max": 1}, speculative_decoding={"method": "mtp"})
    with pytest.raises(ValueError, match="no speculative-decoding method"):
        catalog.speculative_config(plain, 1)


# --- the one-GPU app it starts ------------------------------------------------------------------


def test_smoke_app_is_the_regions_model_on_one_replica_with_throwaway_auth_and_no_peers(tmp_path):
    args = gpu_smoke.load_region_args("fra-01")
    smoke = gpu_smoke.smoke_app_args(args, "qwen-3.5-27b-fp8", tmp_path)  # an alias picks the model
    validated = parse_app_args(smoke)
    (model,) = validated.models
    assert model.id == "qwen-3.5-27b"
    assert (model.autoscaling.min_replicas, model.autoscaling.max_replicas) == (1, 1)
    assert model.resources.num_gpus == 1 and model.resources.accelerator_type == "B200"
    assert model.engine_cli_args("x") == parse_app_args(args).models[1].engine_cli_args("x")
    assert validated.router.num_replicas == 1 and validated.failover.peers == []
    assert validated.telemetry.tracing.enabled is False
    assert validated.auth.key_store_path.startswith(str(tmp_path))
    assert validated.auth.signing_keys_path.startswith(str(tmp_path))
    assert validated.region == "fra-01" and validated.auth.dev_api_key_env is None


@pytest.mark.parametrize("region", ["fra-01", "yul-02", "yvr-01"])
def test_the_smoke_node_offers_what_the_regions_router_asks_of_its_head(tmp_path, region):
    """A region's routers ask for a resource only its head offers; the smoke's one Ray node must offer
    it too, or its router is never placed and the smoke waits for /health until it times out."""
    from ray._common.utils import resources_from_ray_options

    from serve_app.app import router_actor_options

    smoke = gpu_smoke.smoke_app_args(gpu_smoke.load_region_args(region), None, tmp_path)
    asked = resources_from_ray_options(router_actor_options(smoke))
    custom = {name: amount for name, amount in asked.items() if name not in ("CPU", "GPU", "memory")}
    offered = gpu_smoke.node_resources(smoke)
    assert custom and all(offered.get(name, 0) >= amount for name, amount in custom.items())


def test_the_smoke_starts_its_ray_with_the_routers_resource(tmp_path, monkeypatch):
    import ray

    from serve_app.app import RAY_ENV

    started = {}

    class Stop(Exception):
        pass

    def init(**kwargs):
        started.update(kwargs)
        raise Stop  # nothing past the start is wanted here

    monkeypatch.setattr(ray, "init", init)
    for name in (*gpu_smoke.HAPROXY_PORTS, *RAY_ENV):
        monkeypatch.setenv(name, "")  # what local_region sets: put back as it was after the test
    smoke = gpu_smoke.smoke_app_args(gpu_smoke.load_region_args("yul-02"), None, tmp_path)
    with pytest.raises(Stop):
        with gpu_smoke.local_region(smoke):
            pass
    assert started["address"] == "local" and started["resources"] == {"region_credentials": 1}


def test_smoke_key_is_an_inference_key_in_the_throwaway_store(tmp_path):
    from serve_app.auth.keys import KeyStore

    smoke = gpu_smoke.smoke_app_args(gpu_smoke.load_region_args("yul-02"), None, tmp_path)
    key = gpu_smoke.create_smoke_key(smoke["auth"])
    record = KeyStore(tmp_path / "keys.sqlite3", cache_ttl_s=0).lookup(key)
    assert record is not None and record.scopes == ("inference",)
    assert (tmp_path / "signing-keys.json").exists()


@pytest.mark.parametrize(
    ("region", "model", "fragment"),
    [("local", None, "no region config"), ("nowhere", None, "no region config"),
     ("yul-02", "qwen-3.5-27b", "not served by region 'yul-02'")],
)
def test_unknown_regions_and_models_are_refused(region, model, fragment):
    with pytest.raises(gpu_smoke.SmokeError, match=fragment):
        gpu_smoke.engine_flags(gpu_smoke.load_region_args(region), model)


# --- the command's arguments --------------------------------------------------------------------


def invoke(*argv: str):
    return CliRunner().invoke(cli_app, ["gpu-smoke", *argv])


def test_bad_arguments_exit_2_with_the_reason():
    assert invoke().exit_code == 2  # --region is required
    result = invoke("--region", "nowhere")
    assert result.exit_code == 2 and "no region config configs/nowhere.yaml" in result.output
    result = invoke("--region", "yul-02", "--url", "http://127.0.0.1:9")
    assert result.exit_code == 2 and "--url needs --api-key" in result.output


def test_no_gpu_exits_1_after_printing_the_flags(monkeypatch):
    monkeypatch.setattr(gpu_smoke, "check_cuda", lambda accelerator: checks.Check("cuda", False, accelerator))
    result = invoke("--region", "yul-02")
    assert result.exit_code == 1
    assert "FAIL  cuda: RTX-PRO-6000" in result.output and "--model Qwen/Qwen3.6-35B-A3B-FP8" in result.output


def test_an_unreachable_router_fails_the_health_check(monkeypatch):
    import socket

    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = invoke("--region", "yvr-01", "--skip-cuda", "--url", f"http://127.0.0.1:{port}",
                    "--api-key", "k", "--startup-timeout-s", "0")
    assert result.exit_code == 1
    assert "FAIL  health" in result.output and "FAILED: health" in result.output


# --- the checks ---------------------------------------------------------------------------------


def fake_torch(available=True, name="NVIDIA RTX PRO 6000 Blackwell Server Edition", capability=(12, 0)):
    cuda = SimpleNamespace(is_available=lambda: available, get_device_name=lambda i: name,
                           get_device_capability=lambda i: capability, device_count=lambda: 1)
    return SimpleNamespace(cuda=cuda, __version__="2.13.0", version=SimpleNamespace(cuda="13.0"))


def test_cuda_check_wants_a_gpu_of_the_regions_blackwell_type():
    assert checks.check_cuda("RTX-PRO-6000", fake_torch()).ok
    assert checks.check_cuda("B200", fake_torch(name="NVIDIA B200", capability=(10, 0))).ok
    assert "sees no CUDA device" in checks.check_cuda("B200", fake_torch(available=False)).detail
    wrong = checks.check_cuda("B200", fake_torch())
    assert not wrong.ok and "pins B200 (compute capability 10.0)" in wrong.detail
    hopper = checks.check_cuda("RTX-PRO-6000", fake_torch(name="NVIDIA H100", capability=(9, 0)))
    assert not hopper.ok


def chunk(choices=None, usage=None, **extra):
    return ChatCompletionChunk.model_validate({"id": "c", "object": "chat.completion.chunk", "created": 1,
                                               "model": MODEL, "choices": choices or [], "usage": usage, **extra})


def delta(content=None, finish=None):
    return [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]


def test_a_stream_gives_ttft_and_decode_tokens_per_second():
    stream = [(10.1, chunk(delta("Hi"))), (10.2, chunk(delta(" there"))), (10.5, chunk(delta(".", "stop"))),
              (10.5, chunk(usage={"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10})),
              (10.5, chunk(pg_metadata={"inference_ttft_ms": 42.0}))]
    result = checks.measure_stream(stream, started=10.0)
    assert result.ok and result.ttft_ms == pytest.approx(100)
    assert result.tokens_per_s == pytest.approx(4 / 0.4)
    assert "server TTFT 42 ms" in result.detail and "Hi there." in result.detail


def test_a_stream_without_text_or_usage_fails():
    assert not checks.measure_stream([(1, chunk(delta(None, "stop")))], 0).ok
    no_usage = checks.measure_stream([(1, chunk(delta("Hi", "stop")))], 0)
    assert not no_usage.ok and "without a finish_reason or usage" in no_usage.detail


def completion(message, finish="stop"):
    return ChatCompletion.model_validate({"id": "c", "object": "chat.completion", "created": 1, "model": MODEL,
                                          "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                                       "finish_reason": finish}]})


def call(name="get_weather", arguments='{"city": "Montreal"}'):
    return {"content": None, "tool_calls": [{"id": "t1", "type": "function",
                                             "function": {"name": name, "arguments": arguments}}]}


@pytest.mark.parametrize(
    ("message", "ok", "fragment"),
    [(call(), True, 'get_weather({"city": "Montreal"})'), ({"content": "It is sunny."}, False, "no tool call"),
     (call(name="search"), False, "not get_weather"), (call(arguments="{city"), False, "not JSON"),
     (call(arguments='{"town": "Montreal"}'), False, "do not match the schema")],
)
def test_tool_call_check(message, ok, fragment):
    result = checks.check_tool_call(completion(message, "tool_calls" if ok else "stop"))
    assert result.ok is ok and fragment in result.detail


@pytest.mark.parametrize(
    ("content", "ok", "fragment"),
    [('{"city": "Montreal", "country": "Canada", "population": 1762949}', True, "Montreal"),
     ("Montreal, Canada", False, "not JSON"), ('{"city": "Montreal"}', False, "keys differ"),
     ('{"city": "Montreal", "country": "Canada", "population": "1.7M"}', False, "population of the wrong type"),
     ('{"city": "Montreal", "country": "Canada", "population": true}', False, "wrong type")],
)
def test_json_schema_check(content, ok, fragment):
    result = checks.check_json_schema(completion({"content": content}))
    assert result.ok is ok and fragment in result.detail


def test_the_three_requests_go_through_the_official_sdk():
    seen = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body.get("stream"):
            base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
            events = [{**base, "choices": delta("Hi", None)}, {**base, "choices": delta(" there", "stop")},
                      {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
            text += pg_metadata_event({"inference_ttft_ms": 9.0}, chunk_id="c", created=1, model=MODEL)
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   content=(text + "data: [DONE]\n\n").encode())
        if "tools" in body:
            answer = completion(call(), "tool_calls")
        else:
            answer = completion({"content": '{"city": "Montreal", "country": "Canada", "population": 1}'})
        return httpx2.Response(200, json=answer.model_dump(mode="json"))

    client = openai.OpenAI(base_url="http://router/v1", api_key="k", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    ticks = iter(range(100))
    results = checks.run_requests(client, MODEL, clock=lambda: float(next(ticks)))
    assert [(r.name, r.ok) for r in results] == [("chat", True), ("tool call", True), ("json_schema", True)]
    assert results[0].ttft_ms is not None and "server TTFT 9 ms" in results[0].detail
    assert seen[0]["stream_options"] == {"include_usage": True}
    assert seen[1]["tools"] == [checks.WEATHER_TOOL] and seen[1]["tool_choice"] == "auto"
    assert seen[2]["response_format"]["json_schema"]["schema"] == checks.CITY_SCHEMA


def test_an_embedding_model_is_smoke_tested_with_embeddings_not_a_chat_it_would_refuse():
    embed = "qwen-3-embedding-0.6b"
    size = catalog.get(embed).embedding_dimensions
    seen, vectors = [], [[0.5] * size, [0.25] * size]

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append((request.url.path, json.loads(request.content)))
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return httpx2.Response(200, json={"object": "list", "model": embed, "data": data,
                                          "usage": {"prompt_tokens": 8, "total_tokens": 8}})

    client = openai.OpenAI(base_url="http://router/v1", api_key="k", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    (result,) = checks.run_requests(client, embed)
    assert (result.name, result.ok) == ("embeddings", True) and f"{size} dimensions" in result.detail
    assert [path for path, _ in seen] == ["/v1/embeddings"] and seen[0][1]["input"] == checks.EMBED_INPUTS
    vectors[1] = [0.0] * size  # a model that answers zeros is broken
    assert not checks.run_requests(client, embed)[0].ok
    vectors[1] = [0.5] * (size - 1)
    assert "dimensions" in checks.run_requests(client, embed)[0].detail


def test_an_error_answer_fails_that_request_only():
    def handler(request: httpx2.Request) -> httpx2.Response:
        if json.loads(request.content).get("stream"):
            return httpx2.Response(503, json={"error": {"message": "overloaded", "type": "x", "code": "overloaded"}})
        return httpx2.Response(200, json=completion({"content": "{}"}).model_dump(mode="json"))

    client = openai.OpenAI(base_url="http://router/v1", api_key="k", max_retries=0,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    results = checks.run_requests(client, MODEL)
    assert [r.ok for r in results] == [False, False, False]
    assert "InternalServerError" in results[0].detail and "no tool call" in results[1].detail
