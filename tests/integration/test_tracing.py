"""Traces end to end: the openai SDK → Serve → vLLM, exported over OTLP to a real receiver
(Arize Phoenix, tests/integration/otlp_receiver.py), found there by trace id.

The ``otlp_receiver`` session fixture comes from the integration conftest, which also points the
application's ``telemetry.tracing`` at ``otlp_receiver["endpoint_http"]`` before deploying.
The first two tests need only the receiver: they export through serve_app.telemetry's own OTLP
exporters (http/protobuf and gRPC) from this process.
"""

import json
import secrets
import time

import pytest

from serve_app.telemetry import tracing
from serve_app.telemetry.config import TracingArgs
from serve_app.surfaces import CHAT
from serve_app.telemetry.timing import RequestRecord, parse_server_timing

ROUTE_CHAT = CHAT.route

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
ALIAS = "qwen-3.6-a3b"
CHILDREN = {"auth", "network", "queue", "inference"}
PG_FIELDS = {
    "inference_ttft_ms", "inference_total_ms", "queue_ms", "network_ms", "server_ms",
    "region", "replica", "router_replica", "model", "alias", "trace_id",
}
TOLERANCE_MS = 1.0


def client_traceparent() -> tuple[str, str, dict[str, str]]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def request_tree(spans: list[dict], route: str = ROUTE_CHAT) -> tuple[dict, dict[str, dict]]:
    """The request's SERVER span (by name) and its children by name."""
    servers = [s for s in spans if s["name"] == f"POST {route}"]
    assert len(servers) == 1, [s["name"] for s in spans]
    server = servers[0]
    children = {s["name"]: s for s in spans if s["parent_span_id"] == server["span_id"]}
    return server, children


def assert_partition(server: dict, children: dict[str, dict]) -> None:
    assert CHILDREN <= set(children), sorted(children)
    network, queue, inference = children["network"], children["queue"], children["inference"]
    total = network["duration_ms"] + queue["duration_ms"] + inference["duration_ms"]
    assert abs(total - server["duration_ms"]) < TOLERANCE_MS, (total, server["duration_ms"])
    # laid end to end inside the server span (Phoenix keeps microseconds)
    assert abs(network["start_ns"] - server["start_ns"]) < 1e6
    assert abs(network["end_ns"] - queue["start_ns"]) < 1e6
    assert abs(queue["end_ns"] - inference["start_ns"]) < 1e6
    assert abs(inference["end_ns"] - server["end_ns"]) < 1e6
    auth = children["auth"]
    assert server["start_ns"] - 1e6 < auth["start_ns"] <= auth["end_ns"] < network["end_ns"] + 1e6


def assert_pg_metadata_matches(meta: dict, server: dict, children: dict[str, dict]) -> None:
    assert abs(meta["server_ms"] - server["duration_ms"]) < TOLERANCE_MS
    assert abs(meta["network_ms"] - children["network"]["duration_ms"]) < TOLERANCE_MS
    assert abs(meta["queue_ms"] - children["queue"]["duration_ms"]) < TOLERANCE_MS
    assert abs(meta["inference_total_ms"] - children["inference"]["duration_ms"]) < TOLERANCE_MS
    (first_token,) = [e for e in children["inference"]["events"] if e["name"] == "first_token"]
    ttft = (first_token["time_ns"] - children["inference"]["start_ns"]) / 1e6
    assert abs(meta["inference_ttft_ms"] - ttft) < TOLERANCE_MS


def attribute_text(spans: list[dict]) -> str:
    return json.dumps([[s["attributes"], s["events"]] for s in spans], default=str)


# ---------------------------------------------------------------------------------------------
# the exporters against the receiver, without Serve


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_our_otlp_exporter_reaches_the_receiver(otlp_receiver, protocol):
    endpoint = otlp_receiver["endpoint_http" if protocol == "http/protobuf" else "endpoint_grpc"]
    args = TracingArgs(enabled=True, protocol=protocol, endpoint=endpoint)
    tracing.shutdown_tracing()
    otlp_receiver["wait_ready"]()
    tracing.setup_tracing(
        args, region="local", deployment="Router", replica="test", exporter=tracing.otlp_exporter(args),
        set_global=False,
    )
    try:
        trace_id, span_id, headers = client_traceparent()
        record = RequestRecord.begin(ROUTE_CHAT, region="local", replica="test")
        with record.measure_auth():
            time.sleep(0.001)
        record.note_request({"model": ALIAS, "max_tokens": 4}, model=MODEL)
        request_trace = tracing.start_server_span(record, headers)
        time.sleep(0.02)
        record.note_engine({"queue_ms": 1.0, "prefill_ms": 4.0, "decode_ms": 6.0}, {"prompt_tokens": 3, "completion_tokens": 4})
        split = tracing.finish_request_spans(request_trace)
    finally:
        tracing.shutdown_tracing()
    spans = otlp_receiver["spans_for_trace"](trace_id, min_spans=5)
    server, children = request_tree(spans)
    assert server["parent_span_id"] == span_id and server["trace_id"] == trace_id
    assert_partition(server, children)
    assert abs(server["duration_ms"] - split.server_ms) < TOLERANCE_MS
    assert children["inference"]["attributes"]["gen_ai.usage.output_tokens"] == 4


# ---------------------------------------------------------------------------------------------
# through the running application


def test_stream_trace_has_the_three_spans_and_matches_pg_metadata(client, otlp_receiver):
    trace_id, span_id, headers = client_traceparent()
    marker = f"PROMPT-MARKER-{secrets.token_hex(4)}"
    stream = client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": f"Say hi. {marker}"}],
        max_tokens=8,
        temperature=0,  # greedy: a sampled 8-token answer is empty now and then (1 in 30)
        stream=True,
        extra_headers=headers,
    )
    chunks, text = [], ""
    for chunk in stream:  # the SDK loop, unchanged
        chunks.append(chunk)
        text += chunk.choices[0].delta.content or ""
    assert text

    # The timing is on the last chunk before [DONE].
    meta = chunks[-1].pg_metadata
    assert set(meta) >= PG_FIELDS
    assert meta["trace_id"] == trace_id
    assert meta["model"] == MODEL and meta["alias"] == ALIAS and meta["region"]
    assert meta["replica"] and meta["router_replica"]
    assert meta["inference_ttft_ms"] > 0 and meta["inference_total_ms"] >= meta["inference_ttft_ms"]
    assert meta["queue_ms"] >= 0 and meta["network_ms"] >= 0
    parts = meta["network_ms"] + meta["queue_ms"] + meta["inference_total_ms"]
    assert abs(parts - meta["server_ms"]) < 0.01
    assert sum(1 for c in chunks if getattr(c, "pg_metadata", None)) == 1

    spans = otlp_receiver["spans_for_trace"](trace_id, min_spans=5)
    server, children = request_tree(spans)
    assert server["trace_id"] == trace_id and server["parent_span_id"] == span_id  # continues the client
    assert_partition(server, children)
    assert_pg_metadata_matches(meta, server, children)

    attributes = server["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == ALIAS and attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert 0 < attributes["gen_ai.usage.output_tokens"] <= 8
    assert attributes["gen_ai.response.finish_reasons"] and attributes["http.response.status_code"] == 200
    assert attributes["serve_app.region"] == meta["region"] and attributes["serve_app.alias"] == ALIAS
    assert attributes["serve_app.model_replica"] == meta["replica"]
    assert attributes["serve_app.replica"] == meta["router_replica"]
    inference = children["inference"]["attributes"]
    assert inference["serve_app.prefill_ms"] >= 0 and inference["serve_app.decode_ms"] >= 0

    leaked = attribute_text(spans)
    assert marker not in leaked and client.api_key not in leaked and "Bearer" not in leaked


def test_non_stream_server_timing_matches_pg_metadata_and_the_trace(client, otlp_receiver):
    trace_id, span_id, headers = client_traceparent()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, extra_headers=headers
    )
    completion = raw.parse()
    assert completion.choices[0].message.content is not None
    meta = completion.pg_metadata
    assert set(meta) >= PG_FIELDS and meta["trace_id"] == trace_id

    timing = parse_server_timing(raw.headers["server-timing"])
    assert set(timing) == {"network", "queue", "inference", "total"}
    assert timing["total"] == pytest.approx(meta["server_ms"], abs=0.01)
    assert timing["network"] == pytest.approx(meta["network_ms"], abs=0.01)
    assert timing["queue"] == pytest.approx(meta["queue_ms"], abs=0.01)
    assert timing["inference"] == pytest.approx(meta["inference_total_ms"], abs=0.01)

    spans = otlp_receiver["spans_for_trace"](trace_id, min_spans=5)
    server, children = request_tree(spans)
    assert server["parent_span_id"] == span_id
    assert_partition(server, children)
    assert_pg_metadata_matches(meta, server, children)


def test_a_request_without_traceparent_starts_its_own_trace(client, otlp_receiver):
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    trace_id = completion.pg_metadata["trace_id"]
    assert len(trace_id) == 32 and int(trace_id, 16) != 0
    spans = otlp_receiver["spans_for_trace"](trace_id, min_spans=5)
    server, children = request_tree(spans, "/v1/completions")
    assert server["parent_span_id"] is None
    assert server["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert_partition(server, children)
