"""Observability: one trace per request (tracing), Prometheus metrics (metrics), and the
network/queue/inference split both are drawn from (timing, pure). ``config`` is the ``telemetry:``
block of the Serve config's args.

Typical use in the router (see docs/operations.md for the operator's side)::

    record = RequestRecord.begin(route, region=region, replica=replica)
    request_trace = start_server_span(record, request.headers)
    with record.measure_auth():
        caller = authenticate(...)
    record.note_request(body, model=canonical_id)
    ...                                         # engine timing + usage from the replica:
    record.note_engine(engine_timing, usage, finish_reasons, response_id, replica=model_replica_tag)
    split = record.finish(status)
    metadata = pg_metadata(record, split, request_trace.trace_id)
    # stream: the surface's dialect writes the closing (serve_app/surfaces/dialects.py)
    # JSON:   body["pg_metadata"] = metadata; headers["Server-Timing"] = server_timing_header(split)
    finish_request_spans(request_trace, split)
    observe(record, split)

Only ``config`` and ``timing`` are imported here; ``tracing`` (OpenTelemetry SDK) and ``metrics``
(Ray) are imported by name where they are used.
"""

from serve_app.telemetry.config import MetricsArgs, TelemetryArgs, TracingArgs
from serve_app.telemetry.timing import (
    RequestRecord,
    Split,
    compute_split,
    parse_server_timing,
    pg_metadata,
    server_timing_header,
)

__all__ = [
    "MetricsArgs",
    "RequestRecord",
    "Split",
    "TelemetryArgs",
    "TracingArgs",
    "compute_split",
    "parse_server_timing",
    "pg_metadata",
    "server_timing_header",
]
