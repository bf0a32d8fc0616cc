"""``serve-app bench-setting`` (serve_app/bench/setting.py): the setting goes into the Router's
user_config, the values take turns with the order turning, and every batch is counted."""

import asyncio
import json

import httpx
import pytest

from serve_app.bench.setting import bench_setting, config_with, order, summary_table

CONFIG = {"applications": [
    {"name": "llm-m", "deployments": [{"name": "ModelServer", "user_config": {"x": 1}}]},
    {"name": "llm", "deployments": [{"name": "Router", "user_config": {"models": [], "router": {"stall_timeout_s": 30}}}]},
]}


def test_the_value_goes_to_the_routers_user_config_and_the_given_config_is_left_alone():
    changed = config_with(CONFIG, "router.hand_off_streams", False)
    router = changed["applications"][1]["deployments"][0]["user_config"]["router"]
    assert router == {"stall_timeout_s": 30, "hand_off_streams": False}
    assert "hand_off_streams" not in CONFIG["applications"][1]["deployments"][0]["user_config"]["router"]
    assert changed["applications"][0] == CONFIG["applications"][0]  # the model's app untouched
    assert config_with(CONFIG, "usage.flush_interval_s", 2)["applications"][1]["deployments"][0]["user_config"][
        "usage"] == {"flush_interval_s": 2}


def test_a_config_without_a_router_or_a_path_through_a_value_is_refused():
    with pytest.raises(ValueError, match="no Router"):
        config_with({"applications": [CONFIG["applications"][0]]}, "router.x", 1)
    with pytest.raises(ValueError, match="not a mapping"):
        config_with(CONFIG, "router.stall_timeout_s.deeper", 1)


def test_the_order_of_the_values_turns_every_round():
    assert [order(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]


def _sse(tokens: int) -> bytes:
    chunks = [{"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]} for i in range(tokens)]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_each_value_is_applied_before_its_batches_and_summarised_apart():
    applied, current = [], {}
    requests = []

    async def apply(value):
        applied.append(value)
        current["value"] = value

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append((current["value"], request.headers["authorization"]))
        # The setting under test changes what the server does: on, 4 tokens a stream; off, 2.
        return httpx.Response(200, content=_sse(4 if current["value"] else 2),
                              headers={"content-type": "text/event-stream"})

    result = asyncio.run(bench_setting(
        url="http://127.0.0.1:8000", api_key="sk-x", model="m", path="router.hand_off_streams",
        values=[True, False], concurrency=2, requests_per_worker=3, rounds=2, max_tokens=4, ignore_eos=True,
        apply=apply, meter=None, transport=httpx.MockTransport(handler),
    ))
    assert applied == [True, False, False, True]
    # Per batch: 2 warm requests, then 2 workers × 3 counted ones, all sent under the value applied.
    assert len(requests) == 4 * (2 + 6) and all(auth == "Bearer sk-x" for _, auth in requests)
    assert [(b["value"], b["tokens"], b["requests"]) for b in result["batches"]] == [
        (True, 24, 6), (False, 12, 6), (False, 12, 6), (True, 24, 6)]
    on, off = result["summary"]
    assert (on["value"], on["batches"], on["errors"], off["value"]) == (True, 2, 0, False)
    table = summary_table(result)
    assert "router.hand_off_streams=True" in table and "failed requests | 0 | 0" in table
    # Every counted stream's TTFT, none of the warm ones': 2 batches × 6 a value.
    assert [len(b["ttft_ms"]) for b in result["batches"]] == [6, 6, 6, 6]
    every_on = sorted(t for b in result["batches"] if b["value"] for t in b["ttft_ms"])
    assert on["ttft_ms_p50"] == every_on[5] and on["ttft_ms_p95"] == every_on[11]  # nearest rank of 12
    assert "| TTFT p50, ms | " in table and "| TTFT p95, ms | " in table


def test_a_batch_with_failed_requests_or_no_tokens_is_left_out_of_the_means():
    from serve_app.bench.setting import summary

    good = {"value": "a", "tokens": 1000, "tok_s": 860.0, "errors": [], "cpu_per_1k": {"whole service": 1.0}}
    broken = {"value": "a", "tokens": 0, "tok_s": None, "errors": ["http 503"] * 160}  # no CPU per token: none
    partly = {"value": "a", "tokens": 600, "tok_s": 950.0, "errors": ["http 503"] * 60,
              "cpu_per_1k": {"whole service": 0.6}}  # failures take no time: cheaper, no slower
    (row,) = summary([good, broken, partly], ["a"])
    assert row["tok_s"] == 860.0 and row["cpu_per_1k"] == {"whole service": 1.0}
    assert row["batches"] == 3 and row["batches_used"] == 1 and row["errors"] == 220
