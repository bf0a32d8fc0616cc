"""Telemetry where a request does not end the usual way: a client that leaves while the engine works,
a Responses stream's opening events, a caller's traceparent, a stream that fails, an unhandled
error, a peer region's continuation, a router replica that stops, a collector that is away or that
takes a credential in its URL. Real OpenTelemetry SDK objects (an ``InMemorySpanExporter``); the
router ones run the real router on a fake engine (``router_app.py``)."""

import asyncio
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import ValidationError

import fake_vllm
from auth_support import MODEL, bearer
from fake_engine import FakeEngine
from serve_app.router import relay
from serve_app.router.relay import FirstOutput
from serve_app.telemetry import metrics as telemetry_metrics
from serve_app.telemetry import tracing
from serve_app.telemetry.config import TelemetryArgs, TracingArgs, redacted_url
from serve_app.telemetry.request import TRACE_ID_HEADER, RequestTelemetry
from serve_app.telemetry.timing import compute_split, parse_server_timing, pg_metadata, server_timing_header
from serve_app.wire.messages import Accepted, EngineTiming, Generated, StreamOpen, Trailer
from test_telemetry import ROUTE_CHAT, by_name, exporter, fake_metrics, make_record, ms  # noqa: F401 - a fixture

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SERVER = f"POST {ROUTE_CHAT}"


def traceparent(trace_id: str = CLIENT_TRACE_ID, sampled: bool = True) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-{'01' if sampled else '00'}"}


# --- 1. a replica that took the request and reported no engine timing ---------------------------
def _left_after(telemetry: RequestTelemetry, head, *, queued_ms: float, head_at_ms: float, left_at_ms: float):
    """The call stage of a request whose replica's ``head`` came ``head_at_ms`` after receipt, after
    ``queued_ms`` in Serve's queue; its client leaves at ``left_at_ms`` (the clock stops), then the
    replica's last item comes: a bare trailer, no engine timing (vLLM reports on a finished request)."""
    record = telemetry.record
    record.start_perf_ns = time.perf_counter_ns() - round(left_at_ms * 1e6)  # receipt, that long ago
    call = SimpleNamespace(head=head, waited_ms=queued_ms + 10.0, since_head_ms=left_at_ms - head_at_ms)
    with telemetry.stage("call", SimpleNamespace(id="req-1", call=call)):
        pass
    telemetry.finish(499, "client_closed")  # Context.settle(abandoned())
    telemetry.note_trailer(Trailer(complete=False, replica="model#1", generated=Generated(12, 300)))
    telemetry.close(499, "client_closed")
    return record


def test_a_stream_its_client_left_is_queue_and_inference_not_network(exporter):
    """2 s in Serve's queue, 18 s of streaming, the client leaves: 2 s of queue and 18 s of
    inference, the same in the spans, Server-Timing, pg_metadata and the metrics — not 20 s of network."""
    request_metrics, made = fake_metrics()
    telemetry = RequestTelemetry(ROUTE_CHAT, {}, region="yul-02", replica="Router#abc")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(telemetry_metrics, "_metrics", request_metrics)
        record = _left_after(telemetry, StreamOpen(("127.0.0.1", 1), "t", replica_ms=10.0),
                             queued_ms=2000.0, head_at_ms=2050.0, left_at_ms=20050.0)
    split = compute_split(record)
    assert split.engine and split.queue_ms == pytest.approx(2000.0)
    assert split.inference_ms == pytest.approx(18000.0, abs=5) == split.unreported_engine_ms
    assert split.network_ms == pytest.approx(50.0, abs=5) and not split.clamped
    assert split.tokens_per_s is None and split.time_per_output_token_ms is None

    timing = parse_server_timing(server_timing_header(split))
    meta = pg_metadata(record, split, telemetry.trace_id)
    assert timing["queue"] == pytest.approx(2000.0)
    assert timing["inference"] == pytest.approx(split.inference_ms, abs=1e-3)
    assert meta["inference_ttft_ms"] is None and meta["queue_ms"] == pytest.approx(2000.0)
    assert meta["network_ms"] + meta["queue_ms"] + meta["inference_total_ms"] == pytest.approx(meta["server_ms"])

    named = by_name(exporter.get_finished_spans())
    assert {"network", "queue", "inference"} <= set(named)
    durations = [ms(named[n].end_time - named[n].start_time) for n in ("network", "queue", "inference")]
    assert durations == pytest.approx([split.network_ms, split.queue_ms, split.inference_ms], abs=1e-3)
    assert named[SERVER].attributes["serve_app.unreported_engine_ms"] == pytest.approx(split.inference_ms)

    m = telemetry_metrics
    assert [value for value, _ in made[m.NETWORK].points] == [pytest.approx(0.05, abs=0.005)]
    assert [value for value, _ in made[m.QUEUE].points] == [pytest.approx(2.0)]
    assert [value for value, _ in made[m.INFERENCE].points] == [pytest.approx(18.0, abs=0.005)]


def test_an_engine_that_died_after_its_client_left_does_not_stretch_the_request():
    """The client leaves at 5 s (the clock stops); the replica's last item, read up to 10 s
    later, says the engine died: the call's time since its head is then past the request's end."""
    telemetry = RequestTelemetry(ROUTE_CHAT, {}, region="yul-02", replica="Router#abc")
    record = _left_after(telemetry, StreamOpen(("127.0.0.1", 1), "t", replica_ms=10.0),
                         queued_ms=0.0, head_at_ms=40.0, left_at_ms=5040.0)
    server = record.server_ms
    telemetry.note_trailer(Trailer(complete=False, error_code="engine_unavailable", replica="model#1"),
                           engine_ms=14000.0)
    split = compute_split(record)
    assert record.failed_engine_ms == 0 and not split.clamped and split.server_ms == server
    assert split.inference_ms == pytest.approx(5000.0, abs=5)  # the time since its head, as it left


def test_an_accepted_non_stream_request_its_client_left_ran_in_the_engine():
    telemetry = RequestTelemetry(ROUTE_CHAT, {}, region="yul-02", replica="Router#abc")
    record = _left_after(telemetry, Accepted(("127.0.0.1", 1), "t", replica_ms=10.0),
                         queued_ms=0.0, head_at_ms=40.0, left_at_ms=5040.0)
    split = compute_split(record)
    assert split.inference_ms == pytest.approx(5000.0, abs=5) and split.network_ms == pytest.approx(40.0, abs=5)


def test_several_choices_have_a_queue_and_the_time_since_the_head_as_inference():
    """``n`` > 1: vLLM reports no per-request metrics; the replica still ran it from its head on."""
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None)
    record.note_engine(None, {"prompt_tokens": 12, "completion_tokens": 64})
    record.note_router_queue(12.0)
    record.note_head(20.0)
    split = compute_split(record)
    assert (split.network_ms, split.queue_ms, split.inference_ms) == (8.0, 12.0, 80.0)
    assert split.engine and split.unreported_engine_ms == 80.0 and split.tokens_per_s is None
    assert pg_metadata(record, split, None)["inference_ttft_ms"] is None


def test_a_forwarded_request_is_all_network_here_even_after_a_local_head():
    """A replica that vanished after its head: the peer region that served it has the engine time."""
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None)
    record.note_head(20.0)
    record.failover_reason, record.failover_region = "replica_unavailable", "yvr-01"
    split = compute_split(record)
    assert not split.engine and split.network_ms == split.server_ms and split.unreported_engine_ms == 0


def test_a_request_no_peer_took_after_a_local_head_ran_in_our_engine_until_then():
    record = make_record(queue_ms=None, prefill_ms=None, decode_ms=None)
    record.note_head(20.0)
    record.failover_reason = "replica_unavailable"  # tried; every peer refused (failover_region None)
    split = compute_split(record)
    assert split.engine and split.unreported_engine_ms == pytest.approx(split.server_ms - 20.0)
    assert split.network_ms + split.queue_ms + split.inference_ms == pytest.approx(split.server_ms)


def test_the_peers_tried_after_a_local_head_are_network_not_the_dead_engines_inference():
    """The replica died 50 ms after its head; 200 ms of peers refusing followed: those are connects."""
    telemetry = RequestTelemetry(ROUTE_CHAT, {}, region="yul-02", replica="Router#abc")
    record = telemetry.record
    record.start_perf_ns = time.perf_counter_ns() - round(70.0 * 1e6)  # received 70 ms ago
    record.note_head(20.0)  # its head came at 20 ms, its engine died at ~70 ms
    failed_over_at = record.elapsed_ms()
    telemetry.start_failover("replica_unavailable")
    telemetry.note_failover([], None)  # every peer refused
    record.server_ms = failed_over_at + 200.0  # the peers' 200 ms, then the 503
    split = compute_split(record)
    assert split.unreported_engine_ms == pytest.approx(failed_over_at - 20.0, abs=1.0)
    assert split.network_ms >= 200.0 and split.network_ms + split.inference_ms == pytest.approx(split.server_ms)


# --- 2. TTFT of a Responses stream ----------------------------------------------------------------
CREATED = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1"}}\n\n'
IN_PROGRESS = b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n'
ADDED = b'event: response.output_item.added\ndata: {"type":"response.output_item.added"}\n\n'


@pytest.mark.parametrize("cut", [1, 5, 23, len(CREATED) - 1, len(CREATED), len(CREATED) + 7])
def test_a_responses_streams_first_output_is_the_first_event_after_its_opening_ones(cut):
    opening = CREATED + b": keep-alive\n\n" + IN_PROGRESS
    watch = FirstOutput("responses")
    assert not watch.saw(opening[:cut]) and not watch.saw(opening[cut:])  # however the reads cut them
    assert not watch.saw(ADDED[:10])  # "event: re": its name is not all here
    assert watch.saw(ADDED[10:]) and watch.passed


def test_other_streams_first_output_is_their_first_bytes():
    for surface in ("chat", "completions", "messages"):
        assert FirstOutput(surface).saw(b'data: {"id"')


def test_a_responses_streams_ttft_waits_for_the_engines_first_token(router_app, exporter):
    """vLLM sends ``response.created`` and ``.in_progress`` before the engine made a token: TTFT
    counted from them would be the head's trip, whatever the engine's queue and prefill took."""
    fake_vllm.import_vllm()  # on a thread in the replica otherwise: seconds on a busy host
    app = router_app(engine=FakeEngine(tokens=2, latency_s=0.4))  # 0.4 s before each token
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "input": "hi", "stream": True, "store": False, "max_output_tokens": 2}
    response = app.client.post("/v1/responses", json=body, headers=bearer(key))
    assert response.status_code == 200 and "response.output_text.delta" in response.text
    app.recorded()  # settled
    server = by_name(exporter.get_finished_spans())["POST /v1/responses"]
    assert server.attributes["serve_app.ttft_ms"] >= 400.0


# --- 3. the region decides what is sampled ---------------------------------------------------------
def _sampled(ratio: float, headers: dict[str, str]) -> bool:
    tracing.shutdown_tracing()
    spans = InMemorySpanExporter()
    tracing.setup_tracing(TracingArgs(enabled=True, sampling_ratio=ratio), region="r", deployment="d",
                          replica="x", exporter=spans, set_global=False)
    try:
        request_trace = tracing.start_server_span(make_record(), headers)
        tracing.finish_request_spans(request_trace)
        assert request_trace.trace_id == CLIENT_TRACE_ID  # continued either way, for correlation
        assert request_trace.sampled == bool(spans.get_finished_spans())
        return request_trace.sampled
    finally:
        tracing.shutdown_tracing()


def test_a_callers_sampled_flag_does_not_decide_the_regions_ratio_does():
    assert not _sampled(0.0, traceparent(sampled=True))  # anyone, before authentication, could set it
    assert _sampled(1.0, traceparent(sampled=False))


def test_a_continued_trace_is_sampled_by_its_id_alike_in_every_region():
    """TraceIdRatioBased reads the id's low 64 bits: a region and its peer agree on a trace."""
    kept, dropped = "0" * 16 + "0000000000000001", "0" * 16 + "ffffffffffffffff"
    for sampled in (True, False):
        for trace_id, expected in ((kept, True), (dropped, False)):
            headers = traceparent(trace_id, sampled)
            tracing.shutdown_tracing()
            spans = InMemorySpanExporter()
            tracing.setup_tracing(TracingArgs(enabled=True, sampling_ratio=0.5), region="r", deployment="d",
                                  replica="x", exporter=spans, set_global=False)
            try:
                tracing.finish_request_spans(tracing.start_server_span(make_record(), headers))
                assert bool(spans.get_finished_spans()) is expected, (trace_id, sampled)
            finally:
                tracing.shutdown_tracing()


def test_a_callers_tracestate_and_baggage_are_neither_parsed_kept_nor_passed_to_peers(caplog):
    """Read before the credential: parsing them cost the router's loop per request, logged them
    whole, and carried a caller's tracestate to the peer regions and the exported spans."""
    tracing.shutdown_tracing()
    spans = InMemorySpanExporter()
    tracing.setup_tracing(TracingArgs(enabled=True, sampling_ratio=1.0), region="r", deployment="d",
                          replica="x", exporter=spans, set_global=False)
    headers = {**traceparent(), "tracestate": "vendor=" + "x" * 200, "baggage": "k=" + "v" * 9000}
    try:
        with caplog.at_level(logging.DEBUG):
            request_trace = tracing.start_server_span(make_record(), headers)
        forwarded = tracing.propagation_headers(request_trace.span)
        tracing.finish_request_spans(request_trace)
    finally:
        tracing.shutdown_tracing()
    assert request_trace.trace_id == CLIENT_TRACE_ID  # the caller's trace is still continued
    assert set(forwarded) == {"traceparent"} and CLIENT_TRACE_ID in forwarded["traceparent"]
    assert all(len(span.context.trace_state) == 0 for span in spans.get_finished_spans())
    assert "vvvv" not in caplog.text


# --- 3 and 4 on the router: a failed stream, an unhandled error ------------------------------------
def test_a_stream_that_fails_names_its_trace_in_its_head_and_its_request_in_the_log(router_app, caplog):
    app = router_app(engine=FakeEngine(tokens=12, fail_after=3, dies=True))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "stream": True,
            "seed": 1}  # a seeded stream is not resumed: it ends with the engine failure
    with caplog.at_level(logging.WARNING, logger=relay.logger.name):
        response = app.client.post("/v1/chat/completions", json=body, headers={**bearer(key), **traceparent()})
    assert response.status_code == 200 and "engine_unavailable" in response.text
    assert "pg_metadata" not in response.text  # the trace id's only way to the client is the head
    assert response.headers[TRACE_ID_HEADER] == CLIENT_TRACE_ID
    (row,) = app.recorded()
    (line,) = [r.getMessage() for r in caplog.records if "died mid-stream" in r.getMessage()]
    assert row["id"] in line and CLIENT_TRACE_ID in line  # a caller may reuse a trace id; not our id


def test_a_streams_head_carries_its_trace_id(router_app):
    app = router_app(engine=FakeEngine(tokens=2))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = app.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    trace_id = response.headers[TRACE_ID_HEADER]
    assert len(trace_id) == 32 and f'"trace_id":"{trace_id}"' in response.text.replace(" ", "")


def test_a_refused_credential_carries_its_trace_id_but_no_timing_and_a_later_refusal_both(router_app):
    """Whether a key's row was cached (µs) or read from the registry (ms) says whether someone
    used that key lately: another tenant sending its key id with a made-up secret read it off
    ``Server-Timing``. A refusal after authentication keeps its timing."""
    app = router_app(engine=FakeEngine())
    key, record = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    app.client.post("/v1/chat/completions", json=body, headers=bearer(key))  # alice's row, cached
    forged = f"pgk_{record.key_id}_{'x' * 43}"
    refused = app.client.post("/v1/chat/completions", json=body, headers=bearer(forged))
    assert refused.status_code == 401 and "server-timing" not in refused.headers
    assert len(refused.headers[TRACE_ID_HEADER]) == 32
    unknown = app.client.post("/v1/chat/completions", json={**body, "model": "nope"}, headers=bearer(key))
    assert unknown.status_code == 404 and set(parse_server_timing(unknown.headers["server-timing"])) >= {"total"}


def test_a_body_the_engine_refuses_is_all_network_streamed_or_not(router_app):
    """vLLM refusing a body (over the context, a grammar it cannot build) ran no engine: a
    non-stream one refused after the replica's Accepted head is timed as the same body streamed
    (refused before any head) — not Serve's queue and the replica's work as "inference"."""
    app = router_app(engine=FakeEngine(refuse=400))
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for stream in (False, True):
        refused = app.client.post("/v1/chat/completions", json={**body, "stream": stream}, headers=bearer(key))
        assert refused.status_code == 400
        timing = parse_server_timing(refused.headers["server-timing"])
        assert timing.get("queue", 0.0) == timing.get("inference", 0.0) == 0.0, (stream, timing)
        assert timing["network"] == timing["total"] > 0


def test_a_non_stream_request_whose_engine_failed_keeps_its_engine_time(router_app):
    """A 5xx carries no trailer either, but its engine may have run since the replica's head:
    that time stays inference, not network."""
    app = router_app(engine=FakeEngine(fail_before=True))
    app.client._transport.raise_server_exceptions = False
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    failed = app.client.post("/v1/chat/completions", json=body, headers=bearer(key))
    assert failed.status_code == 500
    assert parse_server_timing(failed.headers["server-timing"]).get("inference", 0.0) > 0


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
def test_an_unhandled_error_is_a_500_with_its_trace_id_and_timing(router_app, monkeypatch, path, shape):
    app = router_app(engine=FakeEngine())
    app.client._transport.raise_server_exceptions = False  # as a real server: the client gets the 500
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")

    def bug(name):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(app.services, "resolve", bug)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = app.client.post(path, json=body, headers={**bearer(key), **traceparent()})
    assert response.status_code == 500 and response.headers[TRACE_ID_HEADER] == CLIENT_TRACE_ID
    timing = parse_server_timing(response.headers["server-timing"])
    assert set(timing) == {"network", "total"} and timing["network"] == timing["total"]
    error = response.json()
    assert (error["type"] == "error") if shape == "anthropic" else (error["error"]["code"] == "internal")


# --- 5. a peer region's continuation of a stream ---------------------------------------------------
def test_a_peers_continuation_reports_no_ttft_rate_or_time_per_token():
    """Its output tokens are the whole answer's, its decode the continuation's alone."""
    request_metrics, made = fake_metrics()
    record = make_record()
    record.continuing, record.first_chunk_ms = True, 3.0
    split = compute_split(record)
    assert split.ttft_ms is split.tokens_per_s is split.time_per_output_token_ms is None
    request_metrics.observe(record, split)
    m = telemetry_metrics
    assert made[m.TTFT].points == [] == made[m.TPOT].points and made[m.INFERENCE].points


# --- 6. a router replica that stops -----------------------------------------------------------------
def _routers_own_del():
    from serve_app.router import ingress

    return next(k.__dict__["__del__"] for k in ingress.Router.func_or_class.__mro__
                if getattr(k.__dict__.get("__del__"), "__qualname__", "") == "Router.__del__")


def test_a_stopping_router_exports_its_batched_spans(exporter):
    batched = InMemorySpanExporter()
    tracing._state.provider.add_span_processor(BatchSpanProcessor(batched, schedule_delay_millis=600_000))
    tracing.finish_request_spans(tracing.start_server_span(make_record(), {}))
    assert batched.get_finished_spans() == ()  # waiting for its batch
    router = SimpleNamespace(retrying=None, services=None)
    asyncio.run(_routers_own_del()(router))
    assert len(batched.get_finished_spans()) == 5


def test_flushing_at_exit_is_bounded_and_never_raises(monkeypatch, caplog):
    release = threading.Event()
    monkeypatch.setattr(tracing, "force_flush", lambda timeout_ms: release.wait(10))  # a collector away

    async def stop() -> float:
        started = time.perf_counter()
        try:
            await tracing.flush_before_exit(timeout_s=0.2)
            return time.perf_counter() - started
        finally:
            release.set()  # the export's thread, which asyncio.run waits for as it ends

    assert asyncio.run(stop()) < 2.0

    def broken(timeout_ms):
        raise RuntimeError("exporter broke")

    monkeypatch.setattr(tracing, "force_flush", broken)
    with caplog.at_level(logging.WARNING, logger=tracing.logger.name):
        asyncio.run(tracing.flush_before_exit(timeout_s=0.2))
    assert "could not export the last spans" in caplog.text


# --- 7. a collector away: the SDK's drop warning ----------------------------------------------------
def test_the_sdk_warns_once_not_per_dropped_span(exporter, caplog):
    """Not a fix, a guard: opentelemetry-sdk's ``_shared_internal`` logger has a DuplicateFilter
    (one identical line per 20 s), so a full queue costs ~5 µs per span, not a log line. An SDK
    that drops the filter fails this test: then rate-limit that logger in ``setup_tracing``."""
    released = threading.Event()

    class Stuck(InMemorySpanExporter):  # a collector that does not answer: the queue stays full
        def export(self, spans):
            released.wait(10)
            return super().export(spans)

    tracing._state.provider.add_span_processor(BatchSpanProcessor(
        Stuck(), max_queue_size=1, max_export_batch_size=1, schedule_delay_millis=600_000))
    try:
        with caplog.at_level(logging.WARNING, logger="opentelemetry.sdk._shared_internal"):
            for _ in range(50):  # 250 spans, nearly all dropped
                tracing.finish_request_spans(tracing.start_server_span(make_record(), {}))
    finally:
        released.set()
    assert len([r for r in caplog.records if "Queue full" in r.getMessage()]) <= 2  # a 20 s window may turn


# --- 8. an endpoint with a credential in it ---------------------------------------------------------
SECRET_URL = "https://user:s3cret-token@otel.example:4318/v1/traces?api_key=s3cret-key#s3cret"


def test_the_endpoint_is_logged_without_userinfo_or_query(caplog):
    assert redacted_url(SECRET_URL) == "https://otel.example:4318/v1/traces"
    assert redacted_url("http://[::1]:4317") == "http://[::1]:4317"
    tracing.shutdown_tracing()
    with caplog.at_level(logging.INFO, logger=tracing.logger.name):
        tracing.setup_tracing(TracingArgs(enabled=True, endpoint=SECRET_URL), region="r", deployment="d",
                              replica="x", exporter=InMemorySpanExporter(), set_global=False)
    tracing.shutdown_tracing()
    assert "https://otel.example:4318/v1/traces" in caplog.text and "s3cret" not in caplog.text


@pytest.mark.parametrize("endpoint", ["ftp://user:s3cret@otel.example/v1/traces", "user:s3cret@otel.example:4318"])
def test_a_refused_endpoint_is_not_echoed(endpoint):
    for validate in (lambda: TracingArgs(endpoint=endpoint),  # the router validates the telemetry block alone
                     lambda: TelemetryArgs.model_validate({"tracing": {"endpoint": endpoint}})):
        with pytest.raises(ValidationError) as refused:
            validate()
        assert "s3cret" not in str(refused.value) and "http:// or https://" in str(refused.value)


def test_a_bare_trailer_keeps_the_engine_timing_of_a_request_that_had_it():
    """The unreported time is the fallback only: timing the engine reported wins."""
    record = make_record()
    record.note_head(10.0)
    record.note_engine(EngineTiming())
    assert compute_split(record).unreported_engine_ms == 0.0
