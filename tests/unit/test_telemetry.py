"""serve_app.telemetry without Ray: the timing split, the spans it draws, metrics, config, and the
pg_metadata event read through the real openai SDK."""

import asyncio
import json
import logging
import time

import httpx2
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pydantic import ValidationError

from serve_app.telemetry import metrics as telemetry_metrics
from serve_app.telemetry import tracing
from serve_app.telemetry.config import TelemetryArgs, TracingArgs
from serve_app.surfaces import CHAT, COMPLETIONS
from serve_app.surfaces.dialects import pg_metadata_event
from serve_app.telemetry.timing import (
    RequestRecord,
    compute_split,
    parse_server_timing,
    pg_metadata,
    server_timing_header,
)
from serve_app.wire.sse import data_of

ROUTE_CHAT, ROUTE_COMPLETIONS = CHAT.route, COMPLETIONS.route

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
SECRET_PROMPT = "the launch code is 0000-SECRET-PROMPT"
SECRET_KEY = "sk-live-SECRET-KEY-must-not-leak"


# ---------------------------------------------------------------------------------------------
# helpers


def make_record(
    *,
    server_ms=100.0,
    queue_ms=5.0,
    prefill_ms=20.0,
    decode_ms=60.0,
    auth=(0.5, 1.5),
    route=ROUTE_CHAT,
    status=200,
    output_tokens=31,
) -> RequestRecord:
    record = RequestRecord.begin(route, region="yul-02", replica="Router#abc")
    record.start_ns = 1_700_000_000_000_000_000
    record.note_request(
        {
            "model": "qwen-3.6-a3b",
            "messages": [{"role": "user", "content": SECRET_PROMPT}],
            "stream": True,
            "max_tokens": 32,
            "temperature": 0.7,
            "top_p": 0.9,
        },
        model="qwen-3.6-35b-a3b",
    )
    if auth is not None:
        record.auth_start_ms, record.auth_ms = auth
    if any(v is not None for v in (queue_ms, prefill_ms, decode_ms)):
        record.note_engine(
            {"queue_ms": queue_ms, "prefill_ms": prefill_ms, "decode_ms": decode_ms},
            {"prompt_tokens": 12, "completion_tokens": output_tokens, "total_tokens": 12 + output_tokens},
            ["length"],
            "chatcmpl-123",
            replica="model-qwen#xyz",
        )
    record.server_ms = server_ms
    record.status = status
    return record


@pytest.fixture
def exporter():
    tracing.shutdown_tracing()
    spans = InMemorySpanExporter()
    assert tracing.setup_tracing(
        TracingArgs(enabled=True, sampling_ratio=1.0),
        region="yul-02",
        deployment="Router",
        replica="Router#abc",
        exporter=spans,
        set_global=False,
    )
    yield spans
    tracing.shutdown_tracing()


def by_name(spans):
    return {span.name: span for span in spans}


def ms(ns: int) -> float:
    return ns / 1e6


def traceparent(sampled: bool = True) -> dict[str, str]:
    return {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-{'01' if sampled else '00'}"}


def all_attribute_text(spans) -> str:
    parts = []
    for span in spans:
        parts.append(json.dumps(dict(span.attributes), default=str))
        for event in span.events:
            parts.append(json.dumps(dict(event.attributes), default=str))
        parts.append(json.dumps(dict(span.resource.attributes), default=str))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# the split


def test_split_partitions_the_server_time_exactly():
    split = compute_split(make_record(server_ms=100.0, queue_ms=5.0, prefill_ms=20.0, decode_ms=60.0))
    assert (split.network_ms, split.queue_ms, split.inference_ms) == (15.0, 5.0, 80.0)
    assert split.network_ms + split.queue_ms + split.inference_ms == split.server_ms
    assert split.engine and not split.clamped
    assert split.ttft_ms == pytest.approx(40.0)  # no streamed chunk: server − decode
    assert split.tokens_per_s == pytest.approx(31 / 0.080)
    assert split.time_per_output_token_ms == pytest.approx(2.0)  # 60 ms / 30 tokens


def test_time_waiting_in_serves_queue_is_queue_not_network():
    record = make_record(server_ms=100.0, queue_ms=5.0, prefill_ms=20.0, decode_ms=60.0)
    record.note_router_queue(12.0)  # handle call → head, less the replica's own work
    split = compute_split(record)
    assert (split.network_ms, split.queue_ms, split.inference_ms) == (3.0, 17.0, 80.0)
    assert split.network_ms + split.queue_ms + split.inference_ms == split.server_ms
    record.note_router_queue(-1.0)  # clocks never make a negative wait
    assert record.router_queue_ms == 0.0


def test_without_engine_timing_serves_queue_stays_in_network():
    """A replica whose head was its whole answer (a 503 ``engine_unavailable``, say) and no engine
    timing: no queue span to hold it (a head the engine works on after: test_telemetry_edges.py)."""
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None)
    record.note_router_queue(12.0)
    split = compute_split(record)
    assert split.queue_ms == 0 and split.network_ms == split.server_ms


def test_without_engine_timing_everything_is_network():
    split = compute_split(make_record(queue_ms=None, prefill_ms=None, decode_ms=None, status=503))
    assert not split.engine
    assert split.network_ms == split.server_ms == 100.0
    assert split.queue_ms == split.inference_ms == 0
    assert split.ttft_ms is None and split.tokens_per_s is None


def test_engine_time_above_the_router_time_is_clamped_not_negative():
    split = compute_split(make_record(server_ms=50.0, queue_ms=10.0, prefill_ms=20.0, decode_ms=30.0))
    assert split.clamped and split.network_ms == 0 and split.server_ms == 60.0


def test_finish_stops_the_clock_once_and_streamed_ttft_wins():
    record = RequestRecord.begin(ROUTE_CHAT, region="local", replica="r")
    record.mark_first_chunk()
    first = record.first_chunk_ms
    record.mark_first_chunk()
    assert record.first_chunk_ms == first
    split = record.finish(200)
    time.sleep(0.002)
    assert record.finish().server_ms == split.server_ms
    assert split.ttft_ms == first


def test_measure_auth_records_its_interval_even_when_auth_fails():
    record = RequestRecord.begin(ROUTE_CHAT, region="local", replica="r")
    with pytest.raises(PermissionError), record.measure_auth():
        time.sleep(0.001)
        raise PermissionError
    assert record.auth_start_ms >= 0 and record.auth_ms >= 1.0


def test_note_request_keeps_numbers_and_alias_never_text():
    record = make_record()
    assert record.alias == "qwen-3.6-a3b" and record.model == "qwen-3.6-35b-a3b" and record.stream
    assert record.request_params == {
        "gen_ai.request.max_tokens": 32,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
    }
    assert SECRET_PROMPT not in repr(record)
    long = RequestRecord.begin(ROUTE_CHAT, region="l", replica="r")
    long.note_request({"model": "x" * 10_000})
    assert len(long.alias) == 128


# ---------------------------------------------------------------------------------------------
# what the client sees


def test_pg_metadata_fields_and_their_sum():
    record = make_record()
    split = compute_split(record)
    meta = pg_metadata(record, split, CLIENT_TRACE_ID)
    assert meta == {
        "inference_ttft_ms": 20.0,
        "inference_total_ms": 80.0,
        "queue_ms": 5.0,
        "network_ms": 15.0,
        "server_ms": 100.0,
        "region": "yul-02",
        "replica": "model-qwen#xyz",
        "router_replica": "Router#abc",
        "model": "qwen-3.6-35b-a3b",
        "alias": "qwen-3.6-a3b",
        "trace_id": CLIENT_TRACE_ID,
    }
    odd = make_record(server_ms=97.1234567, queue_ms=0.3333333, prefill_ms=11.1111111, decode_ms=70.7070707)
    odd_meta = pg_metadata(odd, compute_split(odd), None)
    total = odd_meta["network_ms"] + odd_meta["queue_ms"] + odd_meta["inference_total_ms"]
    assert abs(total - odd_meta["server_ms"]) < 0.01


def test_pg_metadata_without_engine_timing():
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None, status=429)
    meta = pg_metadata(record, compute_split(record), CLIENT_TRACE_ID)
    assert meta["inference_ttft_ms"] is None and meta["inference_total_ms"] is None
    assert meta["queue_ms"] is None and meta["network_ms"] == meta["server_ms"] == 100.0
    assert meta["replica"] is None and meta["router_replica"] == "Router#abc"


def test_server_timing_header_is_w3c_and_round_trips():
    record = make_record(server_ms=97.8, queue_ms=0.4, prefill_ms=30.1, decode_ms=55.0)
    header = server_timing_header(compute_split(record))
    assert header == "network;dur=12.300, queue;dur=0.400, inference;dur=85.100, total;dur=97.800"
    assert parse_server_timing(header) == pytest.approx(
        {"network": 12.3, "queue": 0.4, "inference": 85.1, "total": 97.8}
    )
    no_engine = compute_split(make_record(queue_ms=None, prefill_ms=None, decode_ms=None))
    assert server_timing_header(no_engine) == "network;dur=100.000, total;dur=100.000"


def test_pg_metadata_event_is_a_chunk_of_its_stream():
    meta = pg_metadata(make_record(), compute_split(make_record()), CLIENT_TRACE_ID)
    event = pg_metadata_event(meta, chunk_id="chatcmpl-1", created=1, model="m")
    assert event.startswith("event: pg_metadata\ndata: {") and event.endswith("}\n\n")
    chunk = data_of(event)
    assert chunk["id"] == "chatcmpl-1" and chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
    assert chunk["pg_metadata"] == meta
    completion = data_of(pg_metadata_event(meta, chunk_object="text_completion", chunk_id="c", created=1, model="m"))
    assert completion["object"] == "text_completion" and completion["choices"][0]["text"] == ""


def test_sse_data_reads_relayed_events():
    assert data_of('data: {"id": "chatcmpl-9", "created": 5}\n\n') == {"id": "chatcmpl-9", "created": 5}
    assert data_of("data: [DONE]\n\n") is None
    assert data_of(": keep-alive\n\n") is None


# ---------------------------------------------------------------------------------------------
# spans


def test_one_server_span_with_four_children_laid_end_to_end(exporter):
    record = make_record()
    request_trace = tracing.start_server_span(record, {})
    split = tracing.finish_request_spans(request_trace)
    spans = exporter.get_finished_spans()
    named = by_name(spans)
    assert sorted(named) == ["POST /v1/chat/completions", "auth", "inference", "network", "queue"]
    server = named["POST /v1/chat/completions"]
    assert server.kind == SpanKind.SERVER and server.parent is None
    assert server.start_time == record.start_ns
    for name in ("auth", "network", "queue", "inference"):
        child = named[name]
        assert child.parent.span_id == server.context.span_id
        assert child.context.trace_id == server.context.trace_id
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    network, queue, inference = named["network"], named["queue"], named["inference"]
    assert network.start_time == server.start_time
    assert network.end_time == queue.start_time and queue.end_time == inference.start_time
    assert inference.end_time == server.end_time
    durations = [ms(s.end_time - s.start_time) for s in (network, queue, inference)]
    assert abs(sum(durations) - ms(server.end_time - server.start_time)) < 1.0
    assert durations == pytest.approx([split.network_ms, split.queue_ms, split.inference_ms], abs=1e-3)
    auth = named["auth"]
    assert network.start_time <= auth.start_time and auth.end_time <= network.end_time
    assert ms(auth.end_time - auth.start_time) == pytest.approx(1.5, abs=1e-3)
    (first_token,) = inference.events
    assert first_token.name == "first_token"
    assert ms(first_token.timestamp - inference.start_time) == pytest.approx(20.0, abs=1e-3)
    assert request_trace.trace_id == format(server.context.trace_id, "032x")


def test_genai_and_own_attributes(exporter):
    tracing.finish_request_spans(tracing.start_server_span(make_record(), {}))
    named = by_name(exporter.get_finished_spans())
    server = named["POST /v1/chat/completions"].attributes
    assert server["gen_ai.operation.name"] == "chat"
    assert server["gen_ai.request.model"] == "qwen-3.6-a3b"
    assert server["gen_ai.response.model"] == "qwen-3.6-35b-a3b"
    assert server["gen_ai.usage.input_tokens"] == 12 and server["gen_ai.usage.output_tokens"] == 31
    assert tuple(server["gen_ai.response.finish_reasons"]) == ("length",)
    assert server["gen_ai.request.max_tokens"] == 32 and server["gen_ai.request.temperature"] == 0.7
    assert server["gen_ai.response.id"] == "chatcmpl-123"
    assert server["http.response.status_code"] == 200 and server["http.route"] == ROUTE_CHAT
    assert server["serve_app.region"] == "yul-02" and server["serve_app.alias"] == "qwen-3.6-a3b"
    assert server["serve_app.replica"] == "Router#abc" and server["serve_app.model_replica"] == "model-qwen#xyz"
    assert server["serve_app.ttft_ms"] == pytest.approx(40.0)
    assert server["serve_app.tokens_per_s"] == pytest.approx(387.5)
    inference = named["inference"].attributes
    assert inference["serve_app.prefill_ms"] == 20.0 and inference["serve_app.decode_ms"] == 60.0
    assert inference["gen_ai.usage.output_tokens"] == 31
    resource = named["inference"].resource.attributes
    assert resource["service.name"] == "serve_app" and resource["cloud.region"] == "yul-02"
    assert resource["service.instance.id"] == "Router#abc" and resource["serve_app.deployment"] == "Router"


def test_no_prompt_text_or_credentials_in_spans(exporter):
    record = make_record()
    headers = {"authorization": f"Bearer {SECRET_KEY}", "x-api-key": SECRET_KEY, **traceparent()}
    tracing.finish_request_spans(tracing.start_server_span(record, headers))
    text = all_attribute_text(exporter.get_finished_spans())
    assert SECRET_PROMPT not in text and "SECRET" not in text and "Bearer" not in text


def test_incoming_traceparent_is_continued(exporter):
    request_trace = tracing.start_server_span(make_record(), traceparent())
    tracing.finish_request_spans(request_trace)
    server = by_name(exporter.get_finished_spans())["POST /v1/chat/completions"]
    assert request_trace.trace_id == CLIENT_TRACE_ID
    assert format(server.context.trace_id, "032x") == CLIENT_TRACE_ID
    assert format(server.parent.span_id, "016x") == CLIENT_SPAN_ID and server.parent.is_remote
    for span in exporter.get_finished_spans():
        assert format(span.context.trace_id, "032x") == CLIENT_TRACE_ID


def test_a_caller_that_did_not_sample_is_still_sampled_at_the_regions_ratio(exporter):
    """The region's ratio (1.0 here) decides, not the caller's flag (test_telemetry_edges.py)."""
    request_trace = tracing.start_server_span(make_record(), traceparent(sampled=False))
    tracing.finish_request_spans(request_trace)
    assert len(exporter.get_finished_spans()) == 5
    assert request_trace.trace_id == CLIENT_TRACE_ID and request_trace.sampled


def test_error_before_the_engine_is_one_network_span_and_5xx_is_an_error(exporter):
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None, status=503, auth=None)
    record.error_type = "overloaded"
    tracing.finish_request_spans(tracing.start_server_span(record, {}))
    named = by_name(exporter.get_finished_spans())
    assert sorted(named) == ["POST /v1/chat/completions", "network"]
    server, network = named["POST /v1/chat/completions"], named["network"]
    assert (network.start_time, network.end_time) == (server.start_time, server.end_time)
    assert server.status.status_code == StatusCode.ERROR
    assert server.attributes["error.type"] == "overloaded"


def test_client_errors_are_not_span_errors(exporter):
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None, status=401)
    tracing.finish_request_spans(tracing.start_server_span(record, {}))
    server = by_name(exporter.get_finished_spans())["POST /v1/chat/completions"]
    assert server.status.status_code == StatusCode.UNSET and server.attributes["error.type"] == "401"


def test_sampling_ratio_zero_exports_nothing_but_still_mints_a_trace_id():
    tracing.shutdown_tracing()
    spans = InMemorySpanExporter()
    tracing.setup_tracing(
        TracingArgs(enabled=True, sampling_ratio=0.0), region="r", deployment="d", replica="x",
        exporter=spans, set_global=False,
    )
    try:
        for _ in range(20):
            request_trace = tracing.start_server_span(make_record(), {})
            tracing.finish_request_spans(request_trace)
            assert len(request_trace.trace_id) == 32 and request_trace.trace_id != "0" * 32
        assert spans.get_finished_spans() == ()
    finally:
        tracing.shutdown_tracing()


def test_disabled_tracing_records_nothing_but_continues_the_callers_trace_id():
    tracing.shutdown_tracing()
    assert not tracing.setup_tracing(TelemetryArgs(), region="r", deployment="d", replica="x", set_global=False)
    try:
        assert not tracing.tracing_enabled()
        request_trace = tracing.start_server_span(make_record(), traceparent())
        assert not request_trace.span.is_recording() and request_trace.trace_id == CLIENT_TRACE_ID
        split = tracing.finish_request_spans(request_trace)
        assert split.server_ms == 100.0
    finally:
        tracing.shutdown_tracing()


def test_setup_is_idempotent(exporter):
    assert tracing.setup_tracing(TelemetryArgs(), region="r", deployment="d", replica="x", set_global=False)
    tracing.finish_request_spans(tracing.start_server_span(make_record(), {}))
    assert len(exporter.get_finished_spans()) == 5


def test_spans_work_before_setup_without_taking_its_place():
    tracing.shutdown_tracing()
    request_trace = tracing.start_server_span(make_record(), {})
    tracing.finish_request_spans(request_trace)
    assert len(request_trace.trace_id) == 32
    spans = InMemorySpanExporter()
    assert tracing.setup_tracing(
        TracingArgs(enabled=True), region="r", deployment="d", replica="x", exporter=spans, set_global=False
    )
    tracing.finish_request_spans(tracing.start_server_span(make_record(), {}))
    assert len(spans.get_finished_spans()) == 5
    tracing.shutdown_tracing()


# ---------------------------------------------------------------------------------------------
# config and exporters


def test_telemetry_config_defaults_and_strictness():
    args = TelemetryArgs()
    assert not args.tracing.enabled and args.metrics.enabled
    assert args.tracing.protocol == "http/protobuf" and args.tracing.sampling_ratio == 1.0
    for bad in (
        {"tracing": {"sampling_ratio": 1.5}},
        {"tracing": {"protocol": "zipkin"}},
        {"tracing": {"endpont": "http://x"}},
        {"tracing": {"endpoint": "collector:4317"}},
        {"tracing": {"headers_env": {"Authorization": "not a var"}}},
        {"tracing": {"headers": {"Bad Header": "x"}}},
        {"tracing": {"headers": {"a": "1"}, "headers_env": {"A": "B"}}},
        {"tracing": {"resource_attributes": {"service.name": "x"}}},
        {"metrics": {"enabled": True, "port": 9090}},
    ):
        with pytest.raises(ValidationError):
            TelemetryArgs.model_validate(bad)


def test_http_endpoint_gets_the_traces_path_and_headers_come_from_the_environment():
    args = TracingArgs(
        enabled=True,
        endpoint="http://tempo:4318",
        headers={"X-Scope-OrgID": "edge"},
        headers_env={"Authorization": "TEMPO_AUTH"},
    )
    assert args.resolved_endpoint() == "http://tempo:4318/v1/traces"
    assert TracingArgs(endpoint="http://c:4318/otlp/v1/traces").resolved_endpoint() == "http://c:4318/otlp/v1/traces"
    assert TracingArgs(endpoint="http://c:4317", protocol="grpc").resolved_endpoint() == "http://c:4317"
    assert args.resolved_headers({"TEMPO_AUTH": "Basic abc"}) == {
        "X-Scope-OrgID": "edge",
        "Authorization": "Basic abc",
    }
    with pytest.raises(KeyError, match="TEMPO_AUTH"):
        args.resolved_headers({})


def test_otlp_exporters_for_both_protocols(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    monkeypatch.setenv("TRACE_TOKEN", "secret-token")
    http = tracing.otlp_exporter(
        TracingArgs(enabled=True, endpoint="http://127.0.0.1:4318", headers_env={"Authorization": "TRACE_TOKEN"})
    )
    assert isinstance(http, Http)
    grpc = tracing.otlp_exporter(
        TracingArgs(enabled=True, protocol="grpc", endpoint="http://127.0.0.1:4317", headers={"X-Scope-OrgID": "a"})
    )
    assert isinstance(grpc, Grpc)
    http.shutdown()
    grpc.shutdown()


# ---------------------------------------------------------------------------------------------
# metrics


class FakeInstrument:
    def __init__(self, name, tag_keys):
        self.name, self.tag_keys, self.points = name, tag_keys, []

    def observe(self, value, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        self.points.append((value, tags))

    inc = observe


def fake_metrics():
    made = {}

    def histogram(name, description, boundaries, tag_keys):
        assert boundaries == sorted(boundaries) and boundaries[0] > 0 and description
        made[name] = FakeInstrument(name, tag_keys)
        return made[name]

    def counter(name, description, tag_keys):
        made[name] = FakeInstrument(name, tag_keys)
        return made[name]

    return telemetry_metrics.RequestMetrics(factories=(histogram, counter)), made


def test_metrics_observe_one_request():
    request_metrics, made = fake_metrics()
    assert made == {}  # lazily created
    record = make_record()
    request_metrics.observe(record)
    tags = {"region": "yul-02", "model": "qwen-3.6-35b-a3b", "route": ROUTE_CHAT}
    m = telemetry_metrics
    assert made[m.LATENCY].points == [(pytest.approx(0.1), {**tags, "status": "200", "hop": "client"})]
    assert made[m.TTFT].points == [(pytest.approx(0.04), tags)]
    assert made[m.TPOT].points == [(pytest.approx(0.002), tags)]
    assert made[m.QUEUE].points == [(pytest.approx(0.005), tags)]
    assert made[m.NETWORK].points == [(pytest.approx(0.015), tags)]
    assert made[m.INFERENCE].points == [(pytest.approx(0.08), tags)]
    assert made[m.INPUT_TOKENS].points == [(12, tags)] and made[m.OUTPUT_TOKENS].points == [(31, tags)]
    assert made[m.REQUESTS].points == [(1, {**tags, "status": "200", "hop": "client"})]
    assert made[m.ERRORS].points == []


def test_a_request_a_peer_forwarded_here_is_counted_as_the_peers_hop():
    """The origin region counts the request its client sent; this one, which served it, says it
    came from a peer, so a sum over regions of hop="client" counts it once."""
    request_metrics, made = fake_metrics()
    record = make_record(status=503)
    record.forwarded_by, record.error_type = "yul-02", "engine_unavailable"
    request_metrics.observe(record)
    tags = {"region": "yul-02", "model": "qwen-3.6-35b-a3b", "route": ROUTE_CHAT, "status": "503", "hop": "peer"}
    m = telemetry_metrics
    assert made[m.REQUESTS].points == [(1, tags)] and made[m.LATENCY].points == [(pytest.approx(0.1), tags)]
    assert made[m.ERRORS].points == [(1, {**tags, "code": "engine_unavailable"})]


def test_metrics_errors_by_status_and_unresolved_models_are_unknown():
    request_metrics, made = fake_metrics()
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None, status=404)
    record.model, record.error_type = None, "model_not_found"
    request_metrics.observe(record)
    tags = {"region": "yul-02", "model": "unknown", "route": ROUTE_CHAT, "status": "404", "hop": "client"}
    assert made[telemetry_metrics.ERRORS].points == [(1, {**tags, "code": "model_not_found"})]
    assert made[telemetry_metrics.QUEUE].points == [] and made[telemetry_metrics.TTFT].points == []


def test_metrics_count_failovers_and_leave_the_peers_time_out_of_network():
    request_metrics, made = fake_metrics()
    served = make_record(queue_ms=None, prefill_ms=None, decode_ms=None)
    served.failover_reason, served.failover_region = "overloaded", "yvr-01"
    unserved = make_record(queue_ms=None, prefill_ms=None, decode_ms=None, status=503)
    unserved.failover_reason, unserved.error_type = "model_cold", "model_cold"
    request_metrics.observe(served)
    request_metrics.observe(unserved)
    tags = {"region": "yul-02", "model": "qwen-3.6-35b-a3b", "route": ROUTE_CHAT}
    assert made[telemetry_metrics.FAILOVERS].points == [
        (1, {**tags, "reason": "overloaded", "served_by": "yvr-01"}),
        (1, {**tags, "reason": "model_cold", "served_by": "none"}),
    ]
    assert made[telemetry_metrics.NETWORK].points == []
    assert [p[1]["status"] for p in made[telemetry_metrics.REQUESTS].points] == ["200", "503"]


def test_metrics_never_raise_and_can_be_disabled():
    def broken(*args):
        raise RuntimeError("no metrics agent")

    telemetry_metrics.RequestMetrics(factories=(broken, broken)).observe(make_record())
    off, made = fake_metrics()
    off.enabled = False
    off.observe(make_record())
    assert made == {}


def test_ray_serve_metrics_are_created_outside_a_cluster(caplog):
    """The real instruments build and record without a running Ray (a no-op there). ``observe``
    never raises (it logs instead), so the test watches the log."""
    metrics = telemetry_metrics.RequestMetrics()
    with caplog.at_level(logging.ERROR):
        metrics.observe(make_record())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert set(metrics._get()) == set(telemetry_metrics.HISTOGRAMS) | set(telemetry_metrics.COUNTERS)


# ---------------------------------------------------------------------------------------------
# the openai SDK reads a stream that ends with pg_metadata


def chat_stream_bytes(meta) -> bytes:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "qwen-3.6-35b-a3b"}
    deltas = [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}]
    events = [
        "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]})
        for d in deltas
    ]
    events.append(
        "data: "
        + json.dumps({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]})
    )
    body = "".join(f"{event}\n\n" for event in events)
    body += pg_metadata_event(meta, chunk_id="chatcmpl-1", created=1, model="qwen-3.6-35b-a3b")
    return (body + "data: [DONE]\n\n").encode()


def completion_stream_bytes(meta) -> bytes:
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "qwen-3.6-35b-a3b"}
    body = "".join(
        "data: " + json.dumps({**base, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": f}]}) + "\n\n"
        for t, f in (("Hel", None), ("lo", "length"))
    )
    body += pg_metadata_event(meta, chunk_object="text_completion", chunk_id="cmpl-1", created=1, model="qwen-3.6-35b-a3b")
    return (body + "data: [DONE]\n\n").encode()


def sdk_transport(payload: bytes, content_type="text/event-stream", headers=None):
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": content_type, **(headers or {})}, content=payload)

    return httpx2.MockTransport(handler)


@pytest.fixture
def meta():
    record = make_record()
    return pg_metadata(record, compute_split(record), CLIENT_TRACE_ID)


def test_openai_sdk_sync_stream_loop_with_pg_metadata(meta):
    client = openai.OpenAI(
        base_url="http://test/v1", api_key="k", http_client=httpx2.Client(transport=sdk_transport(chat_stream_bytes(meta)))
    )
    stream = client.chat.completions.create(
        model="qwen-3.6-a3b", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text, chunks = "", []
    for chunk in stream:  # the loop from the README, unchanged
        chunks.append(chunk)
        text += chunk.choices[0].delta.content or ""
    assert text == "Hello"
    # How a client reads the timing: the last chunk carries it as an extra field.
    last = chunks[-1]
    assert last.choices[0].delta.content is None and last.choices[0].finish_reason is None
    assert last.pg_metadata == meta
    assert (last.model_extra or {})["pg_metadata"]["trace_id"] == CLIENT_TRACE_ID
    assert [getattr(c, "pg_metadata", None) is not None for c in chunks] == [False] * 4 + [True]


def test_openai_sdk_async_stream_loop_with_pg_metadata(meta):
    async def main():
        client = openai.AsyncOpenAI(
            base_url="http://test/v1",
            api_key="k",
            http_client=httpx2.AsyncClient(transport=sdk_transport(chat_stream_bytes(meta))),
        )
        stream = await client.chat.completions.create(
            model="qwen-3.6-a3b", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text, last = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            last = chunk
        return text, last

    text, last = asyncio.run(main())
    assert text == "Hello" and last.pg_metadata["inference_ttft_ms"] == 20.0


def test_openai_sdk_completions_stream_loop_with_pg_metadata(meta):
    client = openai.OpenAI(
        base_url="http://test/v1",
        api_key="k",
        http_client=httpx2.Client(transport=sdk_transport(completion_stream_bytes(meta))),
    )
    chunks = list(client.completions.create(model="qwen-3.6-a3b", prompt="hi", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hello"
    assert chunks[-1].pg_metadata["server_ms"] == 100.0


def test_openai_sdk_keeps_pg_metadata_and_server_timing_of_a_json_response(meta):
    record = make_record()
    header = server_timing_header(compute_split(record))
    body = {
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "created": 1,
        "model": "qwen-3.6-35b-a3b",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
        "pg_metadata": meta,
    }
    transport = sdk_transport(json.dumps(body).encode(), "application/json", {"Server-Timing": header})
    client = openai.OpenAI(base_url="http://test/v1", api_key="k", http_client=httpx2.Client(transport=transport))
    raw = client.chat.completions.with_raw_response.create(
        model="qwen-3.6-a3b", messages=[{"role": "user", "content": "hi"}]
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "Hi"
    assert completion.pg_metadata == meta
    timing = parse_server_timing(raw.headers["server-timing"])
    assert timing["total"] == pytest.approx(meta["server_ms"], abs=1e-3)
    assert timing["inference"] == pytest.approx(meta["inference_total_ms"], abs=1e-3)


def test_openai_sdk_include_usage_stream_still_ends_with_usage(meta):
    """With include_usage the stream is: deltas, finish, usage chunk (choices=[]), pg_metadata
    carrying the same usage, [DONE]; ``chunks[-1].usage`` and ``if chunk.choices`` loops hold."""
    usage = {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
    payload = chat_stream_bytes(meta).decode()
    usage_chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                   "model": "qwen-3.6-35b-a3b", "choices": [], "usage": usage}
    head, _, _ = payload.partition("event: pg_metadata")
    payload = (
        head
        + f"data: {json.dumps(usage_chunk)}\n\n"
        + pg_metadata_event(meta, chunk_id="chatcmpl-1", created=1, model="m", usage=usage)
        + "data: [DONE]\n\n"
    )
    client = openai.OpenAI(
        base_url="http://test/v1", api_key="k", http_client=httpx2.Client(transport=sdk_transport(payload.encode()))
    )
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert chunks[-1].usage.completion_tokens == 2 and chunks[-1].pg_metadata == meta
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 1


def test_operations_doc_config_snippets_validate():
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).resolve().parents[2] / "docs/operations.md").read_text()
    snippets = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", doc, re.S)]
    telemetry = [s["telemetry"] for s in snippets if isinstance(s, dict) and "telemetry" in s]
    assert len(telemetry) >= 2
    protocols = {TelemetryArgs.model_validate(t).tracing.protocol for t in telemetry}
    assert protocols == {"grpc", "http/protobuf"}


def test_finishing_twice_draws_the_spans_once(exporter):
    request_trace = tracing.start_server_span(make_record(), {})
    first = tracing.finish_request_spans(request_trace)
    assert tracing.finish_request_spans(request_trace) is first
    assert len(exporter.get_finished_spans()) == 5


# --- telemetry wraps the pipeline (router/pipeline.py's loop, RequestTelemetry.stage) --------------
def test_each_stage_is_read_off_the_context_once_it_ran_even_when_it_raised():
    from types import SimpleNamespace

    from serve_app.routing.decisions import Decision, publish
    from serve_app.telemetry.request import RequestTelemetry
    from serve_app.wire.messages import StreamOpen

    telemetry = RequestTelemetry(ROUTE_CHAT, {}, region="local", replica="r")
    ctx = SimpleNamespace(id="req-1", body={}, model=None, call=None)
    with pytest.raises(PermissionError), telemetry.stage("authenticate", ctx):
        time.sleep(0.001)
        raise PermissionError  # a refused key: its auth time is still on its record (the span)
    assert telemetry.record.auth_ms >= 1.0

    ctx.body = {"model": "qwen-3.6-a3b", "stream": True, "temperature": 0.5, "messages": [{"content": "secret"}]}
    with telemetry.stage("parse", ctx):
        pass
    with pytest.raises(LookupError), telemetry.stage("resolve", ctx):
        ctx.model = "qwen-3.6-35b-a3b"
        ctx.body["model"] = ctx.model  # what resolve does: the alias was read before
        raise LookupError
    assert (telemetry.record.alias, telemetry.record.model, telemetry.record.stream) == (
        "qwen-3.6-a3b", "qwen-3.6-35b-a3b", True
    )
    assert "secret" not in json.dumps(telemetry.record.request_params)

    publish("req-1", Decision("prefix", "replica-a", 120, 200))
    head = StreamOpen(("127.0.0.1", 1), "t", replica_ms=4.0)
    ctx.call = SimpleNamespace(head=head, waited_ms=10.0)
    with telemetry.stage("call", ctx):
        pass
    assert telemetry.record.routing.reason == "prefix" and telemetry.record.router_queue_ms == 6.0


def test_no_stage_calls_telemetry():
    """The stages write what they learn into the context; only the loop (and the call's wrapper,
    and a failover's span, whose headers it forwards) touch telemetry."""
    import inspect

    from serve_app.router import pipeline

    for stage in (*pipeline.STAGES, pipeline.call, pipeline.route):
        source = inspect.getsource(stage)
        assert "ctx.record" not in source and "ctx.telemetry" not in source, stage.__name__


def test_a_report_without_any_engine_timing_keeps_the_timing_already_noted():
    """A replica that died mid-stream reports no timing (its trailer is the router's own): a
    resumed stream's earlier engine times stay, not reset to unknown."""
    from serve_app.wire.messages import EngineTiming

    record = make_record()
    record.note_engine(EngineTiming(), replica="model-qwen#xyz")
    assert (record.queue_ms, record.prefill_ms, record.decode_ms) == (5.0, 20.0, 60.0)
    record.note_engine(EngineTiming(queue_ms=1.0))  # a report that has any: it is the call's
    assert (record.queue_ms, record.prefill_ms, record.decode_ms) == (1.0, None, None)


def test_a_peers_continuation_of_a_stream_counts_no_tokens_the_origin_counts_them():
    """A peer's continuation reports the whole answer's usage (the client's one request), which
    the region where the stream began counts from the peer's ending: counted here too, the
    region-summed token counters had every peer-resumed answer twice."""
    request_metrics, made = fake_metrics()
    record = make_record()
    record.continuing = True
    request_metrics.observe(record)
    assert made[telemetry_metrics.REQUESTS].points and made[telemetry_metrics.INFERENCE].points
    assert made[telemetry_metrics.INPUT_TOKENS].points == [] == made[telemetry_metrics.OUTPUT_TOKENS].points
