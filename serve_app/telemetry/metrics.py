"""Prometheus metrics per request, through Ray's metrics agent (``ray.serve.metrics``).

Ray exports custom metrics with a ``ray_`` prefix on each node's metrics port (the same scrape
target as Ray's own metrics), and inside a Serve replica adds ``deployment``, ``replica`` and
``application`` labels by itself. Our labels: ``region``, ``model`` (the canonical id, or
``unknown`` when the name did not resolve — never the caller's raw string, which would make label
cardinality unbounded), ``route`` and, on request counts and latency, ``status``.

Exported series (Prometheus names):

- ``ray_serve_app_time_to_first_token_seconds`` (histogram): server-side TTFT (see ``Split.ttft_ms``)
- ``ray_serve_app_time_per_output_token_seconds`` (histogram): decode time / (output tokens − 1)
- ``ray_serve_app_queue_time_seconds`` (histogram): the ``queue`` span: Serve's queue for a replica
  slot (and the handle's hops) plus the engine's, arrival → first scheduled
- ``ray_serve_app_network_time_seconds`` (histogram): the ``network`` span
- ``ray_serve_app_inference_time_seconds`` (histogram): the ``inference`` span (prefill + decode;
  a replica that took the request but reported no engine timing: its head → the end)
- ``ray_serve_app_request_latency_seconds`` (histogram, + ``status``): the server span, end to end
- ``ray_serve_app_input_tokens_total`` / ``ray_serve_app_output_tokens_total`` (counters)
- ``ray_serve_app_cached_input_tokens_total`` (counter): prompt tokens served from the engine's
  prefix cache (part of the input tokens); the cache-hit ratio is its rate over the input's
- ``ray_serve_app_requests_total`` (counter, + ``status``): every request on an inference route
- ``ray_serve_app_errors_total`` (counter, + ``status``, ``code``): responses with status ≥ 400
- ``ray_serve_app_failovers_total`` (counter, + ``reason``, ``served_by``): requests this region
  forwarded to a peer region (``served_by`` is ``none`` when no peer took them)
- ``ray_serve_app_resumes_total`` (counter, + ``cause``, ``outcome``): streams whose engine failed
  mid-stream, resumed on another replica (``resumed``) or not (``gave_up``)

The instruments are created lazily, on the first observation in the replica, so nothing is built
when the deployment class is pickled, and importing this module needs no running Ray.
"""

import re
import threading
from collections.abc import Callable
from typing import Any

from serve_app.telemetry.config import MetricsArgs, TelemetryArgs
from serve_app.telemetry.timing import RequestRecord, Split, compute_split
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

PREFIX = "serve_app_"
LABELS = ("region", "model", "route")
# ``hop``: "client" (this region's client sent it) or "peer" (a peer region's router forwarded or
# resumed it here; that region counts the request too): a sum over regions takes hop="client".
LABELS_WITH_STATUS = (*LABELS, "status", "hop")
ERROR_LABELS = (*LABELS_WITH_STATUS, "code")

TTFT = "serve_app_time_to_first_token_seconds"
TPOT = "serve_app_time_per_output_token_seconds"
QUEUE = "serve_app_queue_time_seconds"
NETWORK = "serve_app_network_time_seconds"
INFERENCE = "serve_app_inference_time_seconds"
LATENCY = "serve_app_request_latency_seconds"
INPUT_TOKENS = "serve_app_input_tokens_total"
OUTPUT_TOKENS = "serve_app_output_tokens_total"
CACHED_INPUT_TOKENS = "serve_app_cached_input_tokens_total"
REQUESTS = "serve_app_requests_total"
ERRORS = "serve_app_errors_total"
FAILOVERS = "serve_app_failovers_total"
FAILOVER_LABELS = (*LABELS, "reason", "served_by")
RESUMES = "serve_app_resumes_total"
RESUME_LABELS = (*LABELS, "cause", "outcome")

# Seconds. Wide enough for a GPU region (tens of ms) and the CPU default (seconds).
_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600]
_TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 40]
_TPOT_BUCKETS = [0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5]
_SHORT_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]

HISTOGRAMS: dict[str, tuple[str, list[float], tuple[str, ...]]] = {
    TTFT: ("Server-side time to first token: receipt to the stream's first output (streams) or "
           "server time minus decode (JSON responses).", _TTFT_BUCKETS, LABELS),
    TPOT: ("Time per output token after the first (decode time / (output tokens - 1)).", _TPOT_BUCKETS, LABELS),
    QUEUE: ("Queue time (the queue span): Serve's queue for a replica slot plus the engine's, arrival in vLLM "
            "to first scheduled.", _SHORT_BUCKETS, LABELS),
    NETWORK: ("Router and transport time not spent in the engine (the network span).", _SHORT_BUCKETS, LABELS),
    INFERENCE: ("Engine inference time: first scheduled to last token (prefill + decode); without engine "
                "timing, the replica's head to the end.", _LATENCY_BUCKETS, LABELS),
    LATENCY: ("End-to-end server time of a request: receipt to last byte.", _LATENCY_BUCKETS, LABELS_WITH_STATUS),
}
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    INPUT_TOKENS: ("Prompt tokens processed.", LABELS),
    OUTPUT_TOKENS: ("Completion tokens generated.", LABELS),
    CACHED_INPUT_TOKENS: ("Prompt tokens served from the engine's prefix cache (included in input tokens).", LABELS),
    REQUESTS: ("Inference requests answered, by HTTP status; hop=peer: forwarded or resumed here by a peer "
               "region, which counts it too.", LABELS_WITH_STATUS),
    ERRORS: ("Inference requests answered with status >= 400, by status and error code (hop as for requests).",
             ERROR_LABELS),
    FAILOVERS: ("Inference requests forwarded to a peer region, by reason and serving region.", FAILOVER_LABELS),
    RESUMES: ("Streams whose engine failed mid-stream, by cause and whether another replica resumed them.",
              RESUME_LABELS),
}

_CODE = re.compile(r"[^a-z0-9_]")


def _ray_factories() -> tuple[Callable[..., Any], Callable[..., Any]]:
    from ray.serve.metrics import Counter, Histogram

    def histogram(name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...]):
        return Histogram(name, description=description, boundaries=boundaries, tag_keys=tag_keys)

    def counter(name: str, description: str, tag_keys: tuple[str, ...]):
        return Counter(name, description=description, tag_keys=tag_keys)

    return histogram, counter


class RequestMetrics:
    """The request instruments of one process; ``observe`` once per finished request.

    ``factories`` = (histogram(name, description, boundaries, tag_keys), counter(name,
    description, tag_keys)); default: ``ray.serve.metrics``. Tests pass recording fakes.
    """

    def __init__(self, enabled: bool = True, factories: tuple[Callable[..., Any], Callable[..., Any]] | None = None):
        self.enabled = enabled
        self._factories = factories
        self._instruments: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _get(self) -> dict[str, Any]:
        if self._instruments is None:
            with self._lock:
                if self._instruments is None:
                    histogram, counter = self._factories or _ray_factories()
                    instruments: dict[str, Any] = {}
                    for name, (description, buckets, tags) in HISTOGRAMS.items():
                        instruments[name] = histogram(name, description, buckets, tags)
                    for name, (description, tags) in COUNTERS.items():
                        instruments[name] = counter(name, description, tags)
                    self._instruments = instruments
        return self._instruments

    def observe(self, record: RequestRecord, split: Split | None = None) -> None:
        """Record one request. Never raises: a metrics problem must not fail a response."""
        if not self.enabled:
            return
        try:
            self._observe(record, split or compute_split(record))
        except Exception:  # noqa: BLE001 - logged, then dropped on purpose
            logger.exception("recording request metrics failed")

    def _observe(self, record: RequestRecord, split: Split) -> None:
        m = self._get()
        tags = {"region": record.region, "model": record.model or "unknown", "route": record.route}
        with_status = {**tags, "status": str(record.status), "hop": "client" if record.forwarded_by is None else "peer"}
        m[LATENCY].observe(split.server_ms / 1000, tags=with_status)
        m[REQUESTS].inc(1, tags=with_status)
        if record.failover_reason is not None:
            served_by = record.failover_region or "none"
            m[FAILOVERS].inc(1, tags={**tags, "reason": _code(record.failover_reason), "served_by": served_by})
        else:  # a forwarded request's time went to the peer: it is not this region's network time
            m[NETWORK].observe(split.network_ms / 1000, tags=tags)
        if record.status >= 400:
            m[ERRORS].inc(1, tags={**with_status, "code": _code(record.error_type or "none")})
        for outcome, n in (("resumed", record.resumes), ("gave_up", record.resumes_given_up)):
            if n:
                m[RESUMES].inc(n, tags={**tags, "cause": "engine_unavailable", "outcome": outcome})
        if split.engine:
            m[QUEUE].observe(split.queue_ms / 1000, tags=tags)
            m[INFERENCE].observe(split.inference_ms / 1000, tags=tags)
        if split.ttft_ms is not None:
            m[TTFT].observe(split.ttft_ms / 1000, tags=tags)
        if split.time_per_output_token_ms is not None:
            m[TPOT].observe(split.time_per_output_token_ms / 1000, tags=tags)
        if record.continuing:  # a peer's continuation: the whole answer's tokens, counted where it began
            return
        if record.input_tokens:
            m[INPUT_TOKENS].inc(record.input_tokens, tags=tags)
        if record.output_tokens:
            m[OUTPUT_TOKENS].inc(record.output_tokens, tags=tags)
        if record.cached_tokens:
            m[CACHED_INPUT_TOKENS].inc(record.cached_tokens, tags=tags)


def _code(value: str) -> str:
    return _CODE.sub("_", value.lower())[:40]


_metrics: RequestMetrics | None = None


def setup_metrics(args: TelemetryArgs | MetricsArgs | None = None) -> RequestMetrics:
    """This process's ``RequestMetrics`` (created once; instruments still built lazily)."""
    global _metrics
    if _metrics is None:
        metrics = args.metrics if isinstance(args, TelemetryArgs) else (args or MetricsArgs())
        _metrics = RequestMetrics(enabled=metrics.enabled)
    return _metrics


def observe(record: RequestRecord, split: Split | None = None) -> None:
    """Record one finished request with this process's metrics (``setup_metrics`` defaults apply)."""
    setup_metrics().observe(record, split)
