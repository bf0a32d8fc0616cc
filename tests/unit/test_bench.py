"""The benchmark's pieces without a server: percentiles, the SSE parser, the interleaved schedule,
summaries and ratios, the local-only guard. Streams are played through ``httpx.MockTransport``."""

import asyncio
import json
import re

import httpx
import pytest

from serve_app.bench.client import Run, Side, StreamState, chat_body, check_local, side_clients, stream_once
from serve_app.bench.report import admission_line, output_dir, redact_argv
from serve_app.bench.schedule import Batch, plan_batches, run_plan
from serve_app.bench.stats import capacity_ratios, percentile, server_ttft_ms, stream_ratios, summarize
from serve_app.bench.vllm import engine_environment, vllm_command
from serve_app.surfaces import CHAT
from serve_app.surfaces.dialects import pg_metadata_event

ROUTE_CHAT = CHAT.route

METADATA = {"inference_ttft_ms": 40.0, "inference_total_ms": 90.0, "queue_ms": 2.0, "network_ms": 30.0,
            "server_ms": 122.0, "region": "local", "trace_id": "ab" * 16}


def chunk(content=None, usage=None, **delta) -> str:
    choices = [] if usage else [{"index": 0, "delta": {**({"content": content} if content is not None else {}), **delta}}]
    body = {"id": "c1", "object": "chat.completion.chunk", "choices": choices}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def sse_stream(*, metadata=True, usage=True, tokens=("Hi", " there", "!"), done=True) -> str:
    events = [chunk(role="assistant", content="")] + [chunk(t) for t in tokens]
    if usage:
        events.append(chunk(usage={"prompt_tokens": 20, "completion_tokens": len(tokens)}))
    if metadata:
        events.append(pg_metadata_event(METADATA, chunk_id="c1", created=1, model="m",
                                        usage={"completion_tokens": len(tokens)}))
    return "".join(events) + ("data: [DONE]\n\n" if done else "")


def play(text: str, times: list[float] | None = None) -> Run:
    """Feed a stream line by line; event i (blank line i) arrives at times[i]."""
    state, event = StreamState(), 0
    for line in text.split("\n"):
        state.feed(line, (times or [])[event] if times and event < len(times) else 1.0 + event)
        event += line == ""
    state.flush(99.0)
    return state.run("t" * 32, started=0.5, ended=2.0)


# --- percentiles --------------------------------------------------------------------------------
def test_percentile_is_nearest_rank():
    values = list(range(100, 0, -1))  # 1..100, unsorted on purpose
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 100)) == (50, 95, 100)
    assert percentile(values, 0) == 1  # clamped to the first
    assert percentile([7.0], 50) == percentile([7.0], 95) == 7.0
    assert (percentile([10, 20], 50), percentile([10, 20], 95)) == (10, 20)
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([], 50) is None and percentile([None, 4], 50) == 4


# --- SSE parsing --------------------------------------------------------------------------------
def test_stream_parsing_reads_tokens_usage_and_pg_metadata():
    # events: role (t=1), Hi (t=2), there (t=3), ! (t=4), usage, pg_metadata, DONE
    run = play(sse_stream())
    assert run.ok and run.error is None
    assert run.ttft_ms == pytest.approx((2.0 - 0.5) * 1000)  # the empty role chunk is not a token
    assert run.completion_tokens == 3
    assert run.decode_tokens_per_s == pytest.approx((3 - 1) / (4.0 - 2.0))  # TTFT excluded
    assert run.total_ms == pytest.approx(1500)
    assert run.server == METADATA
    assert server_ttft_ms(run.server) == 42.0


def test_stream_parsing_fallbacks_and_failures():
    no_usage = play(sse_stream(usage=False, metadata=False, tokens=("a", "b", "c", "d")))
    assert no_usage.ok and no_usage.completion_tokens == 4 and no_usage.server == {}
    reasoning = play("".join([chunk(reasoning_content="hmm"), chunk(reasoning="x"), "data: [DONE]\n\n"]))
    assert reasoning.ok and reasoning.completion_tokens == 2
    text = play('data: {"choices": [{"index": 0, "text": "hi"}]}\n\ndata: [DONE]\n\n')
    assert text.ok and text.completion_tokens == 1 and text.decode_tokens_per_s is None
    assert play(sse_stream(tokens=())).error == "no token"
    assert play(sse_stream(done=False)).error == "broken stream: no [DONE]"
    error_event = 'data: {"error": {"message": "the model replica failed mid-stream"}}\n\ndata: [DONE]\n\n'
    assert play(chunk("a") + error_event).error == "stream error"


def test_stream_once_sends_a_fresh_traceparent_and_the_body():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text=sse_stream(), headers={"content-type": "text/event-stream"})

    async def go():
        side = Side("ours", "http://127.0.0.1:1", "m", api_key="sk-test")
        async with side_clients([side], 2, transport=httpx.MockTransport(handler)) as clients:
            body = chat_body("m", 8, ignore_eos=True)
            return [await stream_once(clients["ours"], side.url, body) for _ in range(2)]

    runs = asyncio.run(go())
    assert all(r.ok for r in runs) and runs[0].server["region"] == "local"
    parents = [r.headers["traceparent"] for r in seen]
    assert all(re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", p) for p in parents)
    assert parents[0] != parents[1] and [p[3:35] for p in parents] == [r.trace_id for r in runs]
    assert seen[0].headers["authorization"] == "Bearer sk-test"
    body = json.loads(seen[0].content)
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 8


def test_a_run_records_which_admission_its_answer_went_through_and_the_report_says_what_was_not():
    headers = {"budgeted": {"x-ratelimit-limit-requests": "6000", "x-budget-limit-tokens-day": "1000"},
               "rate limited only": {"X-RateLimit-Limit-Requests": "100000"}, "bare": {}}

    def handler(request: httpx.Request) -> httpx.Response:
        key = request.headers["authorization"].removeprefix("Bearer ")
        return httpx.Response(200, text=sse_stream(), headers={"content-type": "text/event-stream", **headers[key]})

    async def go(key):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), headers={"authorization": f"Bearer {key}"}) as client:
            return [await stream_once(client, "http://127.0.0.1:1", chat_body("m", 4)) for _ in range(2)]

    runs = {key: asyncio.run(go(key)) for key in headers}
    assert [r.admission for r in runs["budgeted"]] == [["budget", "rate_limit"]] * 2
    assert runs["rate limited only"][0].admission == ["rate_limit"] and runs["bare"][0].admission == []
    budgeted, dev = summarize(runs["budgeted"], 1.0), summarize(runs["rate limited only"], 1.0)
    assert budgeted["admission"] == {"budget": 2, "rate_limit": 2} and dev["admission"] == {"rate_limit": 2}

    line = admission_line({"1": {"ours": {"summary": budgeted}}, "16": {"ours": {"summary": budgeted}}})
    assert "rate limit on 4, budget on 4 of 4 answers" in line and "not measured" not in line
    line = admission_line({"1": {"ours": {"summary": budgeted}}, "16": {"ours": {"summary": dev}}})
    assert "budget on 2 of 4 answers" in line and "not measured on every answer: budget**" in line


@pytest.mark.parametrize(
    ("handler", "reason"),
    [
        (lambda request: httpx.Response(503, json={"error": {"message": "busy"}}), "HTTP 503"),
        (lambda request: (_ for _ in ()).throw(httpx.ReadError("reset")), "broken stream: ReadError"),
    ],
)
def test_stream_once_counts_failures(handler, reason):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_once(client, "http://127.0.0.1:1", chat_body("m", 4))

    run = asyncio.run(go())
    assert not run.ok and run.error == reason


# --- schedule -----------------------------------------------------------------------------------
def test_plan_interleaves_and_flips_the_order_every_round():
    plan = plan_batches(["ours", "baseline"], runs=25, round_size=10, warmup=2)
    assert plan == [
        Batch("ours", 2, False), Batch("baseline", 2, False),
        Batch("ours", 10, True), Batch("baseline", 10, True),
        Batch("baseline", 10, True), Batch("ours", 10, True),
        Batch("ours", 5, True), Batch("baseline", 5, True),
    ]
    assert plan_batches(["ours"], runs=3, round_size=2, warmup=0) == [Batch("ours", 2, True), Batch("ours", 1, True)]


def test_run_plan_sleeps_before_every_batch_and_never_mixes_sides():
    log, active, peak = [], {"ours": 0, "baseline": 0}, {"ours": 0, "baseline": 0}

    def request(side):
        async def one() -> Run:
            other = "baseline" if side == "ours" else "ours"
            assert active[other] == 0, "both sides had load at once"
            active[side] += 1
            peak[side] = max(peak[side], active[side])
            await asyncio.sleep(0)  # let the other workers start
            active[side] -= 1
            log.append(side)
            return Run(ok=True, completion_tokens=1)
        return one

    async def sleep(seconds):
        log.append(("sleep", seconds))

    plan = plan_batches(["ours", "baseline"], runs=4, round_size=2, warmup=1)
    done = asyncio.run(run_plan(plan, {s: request(s) for s in ("ours", "baseline")}, 2, 0.25, sleep=sleep))
    q = ("sleep", 0.25)
    assert log == [q, "ours", q, "baseline", q, "ours", "ours", q, "baseline", "baseline",
                   q, "baseline", "baseline", q, "ours", "ours"]
    assert peak == {"ours": 2, "baseline": 2}  # concurrency workers at once, not more
    assert len(done["ours"].runs) == 4 and done["ours"].batches == 2  # the warm-up is not counted


def test_run_plan_budget_and_crashing_requests():
    async def boom() -> Run:
        raise RuntimeError("bug")

    async def sleep(_):
        pass

    plan = plan_batches(["ours"], runs=3, round_size=3, warmup=0)
    done = asyncio.run(run_plan(plan, {"ours": boom}, 2, 0, sleep=sleep))
    assert [r.error for r in done["ours"].runs] == ["client error: RuntimeError"] * 3
    skipped = asyncio.run(run_plan(plan, {"ours": boom}, 2, 0, sleep=sleep, budget_s=0))
    assert skipped["ours"].runs == [] and skipped["ours"].batches == 0


# --- summaries and ratios -----------------------------------------------------------------------
def test_summary_definitions():
    runs = [
        Run(ok=True, ttft_ms=100.0, total_ms=500.0, completion_tokens=10, decode_tokens_per_s=20.0,
            server={"inference_ttft_ms": 50.0, "queue_ms": 5.0}),
        Run(ok=True, ttft_ms=120.0, total_ms=600.0, completion_tokens=10, decode_tokens_per_s=30.0,
            server={"inference_ttft_ms": 60.0, "queue_ms": None}),
        Run(ok=False, error="HTTP 503"), Run(ok=False, error="HTTP 503"), Run(ok=False, error="no token"),
    ]
    s = summarize(runs, wall_s=4.0)
    assert (s["runs"], s["ok"], s["errors"]) == (5, 2, 3)
    assert s["error_reasons"] == {"HTTP 503": 2, "no token": 1}
    assert (s["ttft_ms_p50"], s["ttft_ms_p95"]) == (100.0, 120.0)
    assert (s["server_ttft_ms_p50"], s["server_ttft_ms_p95"]) == (55.0, 60.0)
    assert s["network_overhead_ms_p50"] == 45.0  # of the per-request differences 45 and 60
    assert s["decode_tokens_per_s_p50"] == 20.0 and s["aggregate_tokens_per_s"] == 5.0
    bare = summarize([Run(ok=True, ttft_ms=90.0, total_ms=400.0, completion_tokens=4)], wall_s=1.0)
    assert bare["server_ttft_ms_p50"] is None and bare["network_overhead_ms_p50"] is None


def test_ratio_math():
    ours = {"aggregate_tokens_per_s": 80.0, "decode_tokens_per_s_p50": 18.0, "ttft_ms_p50": 150.0, "ttft_ms_p95": 250.0}
    base = {"aggregate_tokens_per_s": 100.0, "decode_tokens_per_s_p50": 20.0, "ttft_ms_p50": 100.0, "ttft_ms_p95": 200.0}
    r = stream_ratios(ours, base)
    assert r["aggregate_tokens_per_s"] == pytest.approx(0.8) and r["decode_tokens_per_s_p50"] == pytest.approx(0.9)
    assert r["ttft_overhead_p50"] == {"ms": 50.0, "pct": 50.0}
    assert r["ttft_overhead_p95"] == {"ms": 50.0, "pct": 25.0}
    missing = stream_ratios({**ours, "ttft_ms_p50": None}, {**base, "aggregate_tokens_per_s": 0})
    assert missing["aggregate_tokens_per_s"] is None and missing["ttft_overhead_p50"] == {"ms": None, "pct": None}
    c = capacity_ratios({"requests_per_s": 300.0, "latency_ms_p50": 12.0, "latency_ms_p95": 30.0},
                        {"requests_per_s": 600.0, "latency_ms_p50": 8.0, "latency_ms_p95": 20.0})
    assert c["requests_per_s"] == 0.5 and c["latency_overhead_p50"] == {"ms": 4.0, "pct": 50.0}


# --- guards and metadata ------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/", "http://127.0.0.2:1", "http://[::1]:80"])
def test_local_targets_are_accepted(url):
    assert check_local(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["https://api.yul-02.edge.polargrid.ai", "http://10.0.0.5:8000", "http://127.0.0.1.nip.io",
                                 "ftp://127.0.0.1"])
def test_other_targets_are_refused(url):
    with pytest.raises(ValueError, match="only targets 127.0.0.1 / localhost"):
        check_local(url)


def test_keys_never_reach_the_command_line_record():
    argv = ["serve-app", "bench", "--api-key", "sk-secret", "--baseline-api-key=sk-two", "--runs", "5"]
    assert redact_argv(argv) == ["serve-app", "bench", "--api-key", "***", "--baseline-api-key=***", "--runs", "5"]


def test_bare_vllm_runs_at_ray_worker_niceness(tmp_path):
    import datetime

    assert vllm_command(["--model", "m"], 9, 15)[:3] == ["nice", "-n", "15"]
    assert vllm_command(["--model", "m"], 9, None)[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    when = datetime.datetime(2026, 6, 9, 23, 59, tzinfo=datetime.UTC)
    assert output_dir(tmp_path, "yul-02", "qwen-3.6-35b-a3b", when) == tmp_path / "yul-02-2026-06-09" / "qwen-3.6-35b-a3b"


def test_bare_vllm_gets_the_replicas_openmp_threads_as_ray_sets_them_and_the_models_variables():
    """Ray gives a worker without OMP_NUM_THREADS the floor of its CPUs (at least 1): the local
    replica's 0.5 CPU runs one OpenMP thread, and so must bare vLLM."""
    assert engine_environment({"PATH": "/bin"}, {"VLLM_CPU_KVCACHE_SPACE": "1"}, 0.5) == {
        "PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    assert engine_environment({}, {}, 8.7)["OMP_NUM_THREADS"] == "8"
    assert engine_environment({}, {}, None)["OMP_NUM_THREADS"] == "1"
    # Set by whoever started the bench (Ray's workers inherit it too), or by the model: kept.
    assert engine_environment({"OMP_NUM_THREADS": "2"}, {}, 0.5)["OMP_NUM_THREADS"] == "2"
    assert engine_environment({}, {"OMP_NUM_THREADS": "4"}, 0.5)["OMP_NUM_THREADS"] == "4"


def test_bare_vllm_takes_the_flags_of_the_replica_it_is_compared_with():
    import copy

    import yaml

    from serve_app.bench.vllm import replica_model
    from serve_app.paths import REPO_ROOT

    config = yaml.safe_load((REPO_ROOT / "configs" / "local.yaml").read_text())  # a chat and an embedding model
    served = [app["args"]["model"]["id"] for app in config["applications"] if "model" in (app.get("args") or {})]
    assert len(served) == 2 and replica_model(config).id == served[0]
    assert replica_model(config, served[1]).id == served[1]  # --model names the second: its flags, not the first's
    assert replica_model(config, "qwen-3.6-a3b").id == "qwen-3.6-35b-a3b"  # an alias names its model
    with pytest.raises(ValueError, match="serves no model 'nope'"):
        replica_model(config, "nope")
    drifted = copy.deepcopy(config)
    model_app = next(app for app in drifted["applications"] if (app.get("args") or {}).get("model", {}).get("id")
                     == served[0])
    model_app["args"]["model"]["max_ongoing_requests"] = 7  # the replica runs what the router's list does not say
    with pytest.raises(ValueError, match="not what its router's settings render"):
        replica_model(drifted, served[0])
