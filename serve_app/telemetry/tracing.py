"""One trace per request: a SERVER span at the router with ``auth``, ``network``, ``queue`` and
``inference`` children, exported over OTLP (http/protobuf or gRPC).

Who owns the tracer provider: **we do**, in the router replicas. ``setup_tracing`` installs the
process-wide provider once (idempotent). The model replicas start vLLM without
``--otlp-traces-endpoint``, so vLLM never calls ``init_tracer`` and never installs a provider of
its own; they emit no spans — the engine's timestamps reach the trace through the router, which
draws the ``queue`` and ``inference`` spans from them. If something else installed a global
provider first (Ray Serve's own tracing via ``RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH``, say), we
leave it alone, log a warning and export through a private provider, so our sampling and endpoint
still hold.

Spans are created after the fact with explicit timestamps from one ``Split``
(``serve_app.telemetry.timing``): network [start, start+N], queue [start+N, start+N+Q],
inference [start+N+Q, end], so the three durations add up to the server span exactly. Attributes
follow the OpenTelemetry GenAI semantic conventions; prompt and completion text, the
``Authorization`` header and API keys are never recorded.

With tracing disabled, spans are not recorded or exported, but trace ids are still minted (and an
incoming ``traceparent`` still continues), so ``pg_metadata.trace_id`` always identifies the request
in logs.

Sampling is the region's, never the caller's: ``sampling_ratio`` decides for every trace, one that
arrives with a ``traceparent`` included (whose sampled flag anyone can set, before authentication),
from the trace id alone (``TraceIdRatioBased``), so the regions a request crosses keep or drop it
alike. The caller's trace id is still continued, for correlation.
"""

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from serve_app.telemetry.config import TelemetryArgs, TracingArgs, redacted_url
from serve_app.telemetry.timing import RequestRecord, Split
from serve_app.telemetry.logs import module_logger
from serve_app.telemetry.span_attributes import (
    genai_attributes,
    inference_attributes,
    routing_attributes,
    server_attributes,
)

logger = module_logger(__name__)

INSTRUMENTATION_NAME = "serve_app"
SPAN_AUTH, SPAN_NETWORK, SPAN_QUEUE, SPAN_INFERENCE = "auth", "network", "queue", "inference"
SPAN_FAILOVER = "failover"
SPAN_RESUME = "resume"
EVENT_FIRST_TOKEN = "first_token"
FLUSH_AT_EXIT_S = 3.0  # a stopping router replica's wait for its last spans' export


@dataclass
class _State:
    provider: TracerProvider
    tracer: trace.Tracer
    enabled: bool
    owns_global: bool


_state: _State | None = None
_fallback: trace.Tracer | None = None
# W3C trace context alone: a request's traceparent in, a peer's out (``start_server_span``).
_TRACE_CONTEXT = TraceContextTextMapPropagator()
_lock = threading.Lock()


@dataclass
class RequestTrace:
    """The SERVER span of one request and what the response needs from it."""

    span: Span
    context: Context  # the span in its (possibly client-continued) context, for child work
    trace_id: str  # 32 lower-case hex digits
    span_id: str  # 16 hex digits
    sampled: bool
    record: RequestRecord
    split: Split | None = None  # set by finish_request_spans; a second call returns it unchanged


def setup_tracing(
    args: TelemetryArgs | TracingArgs | None,
    *,
    region: str,
    deployment: str,
    replica: str,
    model: str | None = None,
    exporter: SpanExporter | None = None,
    set_global: bool = True,
) -> bool:
    """Install this process's tracer provider once; later calls are no-ops. True if spans export.

    ``region``, ``deployment`` (Serve deployment name) and ``replica`` (Serve replica id) become
    resource attributes (``cloud.region``, ``serve_app.*``, ``service.instance.id``); ``model``
    too where a process serves one model. ``exporter`` replaces the OTLP exporter (tests: an
    ``InMemorySpanExporter``, exported synchronously). ``set_global=False`` keeps the provider
    private (tests; the global provider can be set only once per process).
    """
    global _state
    tracing = args.tracing if isinstance(args, TelemetryArgs) else (args or TracingArgs())
    with _lock:
        if _state is not None:
            return _state.enabled
        resource = Resource.create(_resource_attributes(tracing, region, deployment, replica, model))
        if not tracing.enabled:
            # Ids are still minted (pg_metadata.trace_id), nothing is recorded or exported.
            provider = TracerProvider(resource=resource, sampler=ALWAYS_OFF)
            _state = _State(provider, provider.get_tracer(INSTRUMENTATION_NAME), False, False)
            return False
        provider = TracerProvider(resource=resource, sampler=region_sampler(tracing.sampling_ratio))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            provider.add_span_processor(BatchSpanProcessor(otlp_exporter(tracing)))
        owns_global = False
        if set_global:
            current = trace.get_tracer_provider()
            if isinstance(current, trace.ProxyTracerProvider):
                trace.set_tracer_provider(provider)
                owns_global = True
            else:
                logger.warning(
                    "a global OpenTelemetry tracer provider is already installed (%s; Ray Serve "
                    "tracing or vLLM's --otlp-traces-endpoint?). serve_app exports its request "
                    "spans through its own provider and leaves that one alone.",
                    type(current).__name__,
                )
        _state = _State(provider, provider.get_tracer(INSTRUMENTATION_NAME), True, owns_global)
        endpoint = tracing.resolved_endpoint()
        logger.info(
            "tracing on: OTLP %s to %s, sampling %.3g, service %s",
            tracing.protocol,
            redacted_url(endpoint) if endpoint else "the OTEL_EXPORTER_OTLP_* default",
            tracing.sampling_ratio,
            tracing.service_name,
        )
        return True


def region_sampler(ratio: float) -> ParentBased:
    """``ratio`` of traces by their trace id, whatever a remote parent's sampled flag says (a
    caller could set it on every request, or clear it); a local parent (the SERVER span, for its
    children) is followed, so a trace is kept or dropped whole."""
    by_id = TraceIdRatioBased(ratio)
    return ParentBased(root=by_id, remote_parent_sampled=by_id, remote_parent_not_sampled=by_id)


def otlp_exporter(tracing: TracingArgs) -> SpanExporter:
    """The OTLP span exporter for ``tracing.protocol``; ``headers_env`` values are read now."""
    headers = tracing.resolved_headers()
    if tracing.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        # gRPC metadata keys must be lower case; http:// means plaintext, https:// TLS.
        return Grpc(
            endpoint=tracing.endpoint,
            headers={k.lower(): v for k, v in headers.items()} or None,
            timeout=tracing.export_timeout_s,
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=tracing.resolved_endpoint(), headers=headers or None, timeout=tracing.export_timeout_s)


def tracing_enabled() -> bool:
    return _state is not None and _state.enabled


def shutdown_tracing() -> None:
    """Flush and stop this process's provider (a replica's shutdown; tests between cases)."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


def force_flush(timeout_ms: int = 5000) -> bool:
    return _state.provider.force_flush(timeout_ms) if _state is not None else True


async def flush_before_exit(timeout_s: float = FLUSH_AT_EXIT_S) -> None:
    """Export the spans still batched, off the event loop, waiting ``timeout_s`` at most; never
    raises. For a replica Serve is stopping: it kills the actor afterwards, so no atexit hook runs
    and a batch (5 s of spans) would be lost."""
    try:
        await asyncio.wait_for(asyncio.to_thread(force_flush, int(timeout_s * 1000)), timeout_s)
    except Exception:  # noqa: BLE001 - a collector away must not hold up or fail the shutdown
        logger.warning("could not export the last spans within %.0f s", timeout_s, exc_info=True)


def _tracer() -> trace.Tracer:
    global _fallback
    if _state is not None:
        return _state.tracer
    # Not set up (a unit test, or a process that never called setup_tracing): mint ids only,
    # without taking the place a later setup_tracing call will fill.
    if _fallback is None:
        _fallback = TracerProvider(sampler=ALWAYS_OFF).get_tracer(INSTRUMENTATION_NAME)
    return _fallback


def start_server_span(record: RequestRecord, headers: Mapping[str, str]) -> RequestTrace:
    """Open the request's SERVER span at ``record.start_ns``, continuing a W3C ``traceparent``.

    ``headers`` is the request's headers (Starlette ``Headers`` or a dict): only ``traceparent``
    is read. Not the global propagator, which also parses ``tracestate`` and ``baggage`` for every
    request before its credential is checked: an 8 KB ``baggage`` cost ~0.65 ms of the router's
    loop and was logged whole, once a request; a ``tracestate`` went on to the peer regions and the
    exported spans. Nothing here reads either.
    """
    parent = _TRACE_CONTEXT.extract({"traceparent": headers.get("traceparent") or ""})
    span = _tracer().start_span(
        f"{record.method} {record.route}",
        context=parent,
        kind=SpanKind.SERVER,
        start_time=record.start_ns,
        attributes={
            "http.request.method": record.method,
            "http.route": record.route,
            "url.path": record.route,
            "gen_ai.operation.name": record.operation,
            "serve_app.region": record.region,
            "serve_app.replica": record.replica,
        },
    )
    ctx = span.get_span_context()
    return RequestTrace(
        span=span,
        context=trace.set_span_in_context(span, parent),
        trace_id=trace.format_trace_id(ctx.trace_id),
        span_id=trace.format_span_id(ctx.span_id),
        sampled=ctx.trace_flags.sampled,
        record=record,
    )


def finish_request_spans(request: RequestTrace, split: Split | None = None) -> Split:
    """Draw the children from ``split`` (default: ``request.record.finish()``) and end the server span.

    Children, all parented to the SERVER span and laid end to end: ``network``, ``queue``,
    ``inference`` (with a ``first_token`` event at start + prefill); ``auth`` at its real interval
    (inside ``network``). With neither a replica's head nor engine timing (``Split.engine``) there
    is only ``network`` (= the whole request).
    Call after the response's last byte (stream) or when the JSON response is built; calling it
    again (an error path and a ``finally``, say) does nothing and returns the first split.
    """
    if request.split is not None:
        return request.split
    record = request.record
    if split is None:
        split = record.finish()
    request.split = split
    span = request.span
    start = record.start_ns

    def at(offset_ms: float) -> int:
        return start + round(offset_ms * 1e6)

    end = at(split.server_ms)
    if not span.is_recording():
        span.end(end_time=end)
        return split

    tracer = _tracer()
    parent = request.context
    common = {"serve_app.region": record.region}

    if record.auth_ms is not None and record.auth_start_ms is not None:
        auth_start = max(record.auth_start_ms, 0.0)
        auth_end = min(auth_start + record.auth_ms, split.server_ms)
        tracer.start_span(SPAN_AUTH, context=parent, start_time=at(auth_start), attributes=common).end(
            end_time=at(auth_end)
        )

    network = tracer.start_span(
        SPAN_NETWORK,
        context=parent,
        start_time=start,
        attributes={**common, "serve_app.network_ms": split.network_ms},
    )
    network.end(end_time=at(split.network_ms))

    if split.engine:
        queue_start = split.network_ms
        inference_start = queue_start + split.queue_ms
        tracer.start_span(
            SPAN_QUEUE,
            context=parent,
            start_time=at(queue_start),
            attributes={**common, "serve_app.queue_ms": split.queue_ms},
        ).end(end_time=at(inference_start))
        inference = tracer.start_span(
            SPAN_INFERENCE,
            context=parent,
            start_time=at(inference_start),
            attributes={**common, **genai_attributes(record), **routing_attributes(record), **inference_attributes(split)},
        )
        if split.prefill_ms is not None:
            inference.add_event(
                EVENT_FIRST_TOKEN,
                attributes={"serve_app.prefill_ms": split.prefill_ms},
                timestamp=at(inference_start + split.prefill_ms),
            )
        inference.end(end_time=end)

    span.set_attributes(server_attributes(record, split))
    if record.status >= 500:
        span.set_status(Status(StatusCode.ERROR, record.error_type or f"HTTP {record.status}"))
    span.end(end_time=end)
    return split


def start_failover_span(request: RequestTrace, reason: str) -> Span:
    """A CLIENT span, child of the SERVER span, for the forward to a peer region. Unlike the other
    children it is started live: the peer continues the trace from it (``propagation_headers``)."""
    return _tracer().start_span(
        SPAN_FAILOVER,
        context=request.context,
        kind=SpanKind.CLIENT,
        attributes={"serve_app.region": request.record.region, "serve_app.failover.reason": reason},
    )


def start_resume_span(request: RequestTrace, cause: str, tokens: int) -> Span:
    """An INTERNAL span, child of the SERVER span, from a stream's engine failure to the first
    byte of its continuation on another replica (started live: its end is the seam)."""
    return _tracer().start_span(
        SPAN_RESUME,
        context=request.context,
        attributes={"serve_app.region": request.record.region, "serve_app.resume.cause": cause,
                    "serve_app.resume.generated_tokens": tokens},
    )


def end_resume_span(span: Span, resumed: bool, region: str | None = None) -> None:
    span.set_attribute("serve_app.resume.resumed", resumed)
    if region is not None:  # a peer region's replica continued it
        span.set_attribute("serve_app.resume.region", region)
    if not resumed:
        span.set_status(Status(StatusCode.ERROR, "no replica resumed the stream"))
    span.end()


def propagation_headers(span: Span) -> dict[str, str]:
    """``traceparent`` naming ``span`` as the parent of the peer's SERVER span."""
    headers: dict[str, str] = {}
    _TRACE_CONTEXT.inject(headers, context=trace.set_span_in_context(span))
    return headers


def note_failover_attempts(span: Span, attempts: list, served_by: str | None) -> None:
    """Each try as ``region:outcome:status`` (e.g. ``yvr-01:unavailable:503``), and who answered."""
    span.set_attribute(
        "serve_app.failover.attempts", [f"{a.region}:{a.outcome}:{a.status or '-'}" for a in attempts]
    )
    if served_by is not None:
        span.set_attribute("serve_app.failover.region", served_by)
    else:
        span.set_status(Status(StatusCode.ERROR, "no peer region took the request"))


def end_failover_span(span: Span, record: RequestRecord, split: Split) -> None:
    span.set_attribute("http.response.status_code", record.status)
    span.end(end_time=record.start_ns + round(split.server_ms * 1e6))


def _resource_attributes(
    tracing: TracingArgs, region: str, deployment: str, replica: str, model: str | None
) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "service.namespace": "serve_app",
        "service.instance.id": replica,
        "cloud.region": region,
        "serve_app.region": region,
        "serve_app.deployment": deployment,
        "serve_app.replica": replica,
    }
    if model:
        attributes["serve_app.model"] = model
    return {**attributes, **tracing.resource_attributes, "service.name": tracing.service_name}


__all__ = [
    "RequestTrace",
    "finish_request_spans",
    "flush_before_exit",
    "force_flush",
    "otlp_exporter",
    "setup_tracing",
    "shutdown_tracing",
    "start_server_span",
    "tracing_enabled",
]
