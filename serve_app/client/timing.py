"""Where a request's time went on the server, and the trace it belongs to.

The server reports the same numbers two ways (docs/api.md, "Server timing"): a stream's last
event before ``[DONE]`` (``event: pg_metadata``), and for a JSON response a ``pg_metadata`` body
field plus a W3C ``Server-Timing`` header. ``ServerTiming`` is built from whichever arrived, plus
the headers that say who served (``x-pg-region``, ``x-pg-failover-from``).

Every request carries a fresh W3C ``traceparent`` the client makes (or the caller's own), so the
server's span is a child of it and ``pg_metadata.trace_id`` is the id the client already knows.
"""

import random
import re
import secrets
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

REGION_HEADER = "x-pg-region"
FAILOVER_FROM_HEADER = "x-pg-failover-from"
# Server-Timing metric → the pg_metadata field it stands for, when a body has no pg_metadata.
_HEADER_FIELDS = {"network": "network_ms", "queue": "queue_ms", "inference": "inference_total_ms", "total": "server_ms"}
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


class ServerTiming(BaseModel):
    """The server's account of one request, in milliseconds (None where it reported none).

    ``network_ms + queue_ms + inference_total_ms == server_ms`` when the engine reported timing;
    ``queue_ms`` and the inference numbers are None when it did not (``n`` > 1, or an error before
    the engine). Fields the server adds later are kept (``extra="allow"``).
    """

    model_config = ConfigDict(extra="allow")

    inference_ttft_ms: float | None = None
    inference_total_ms: float | None = None
    queue_ms: float | None = None
    network_ms: float | None = None
    server_ms: float | None = None
    region: str | None = None
    replica: str | None = None
    router_replica: str | None = None
    model: str | None = None
    alias: str | None = None
    trace_id: str | None = None
    failover_from: str | None = None
    # The parsed Server-Timing header of a JSON response ({"network": 12.3, ...}); empty for streams.
    server_timing: dict[str, float] = Field(default_factory=dict)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``{"network": 12.3, ...}`` from ``network;dur=12.3, queue;dur=0.4, ...``; unknown params ignored."""
    metrics: dict[str, float] = {}
    for entry in (header or "").split(","):
        name, _, params = entry.strip().partition(";")
        match = re.search(r"(?:^|;)\s*dur=([0-9.]+)", params)
        if name and match:
            metrics[name.strip()] = float(match.group(1))
    return metrics


def server_timing(
    headers: Mapping[str, str], metadata: Mapping[str, Any] | None, *, trace_id: str | None
) -> ServerTiming:
    """One ServerTiming from a response's headers and its ``pg_metadata`` (either may be missing).

    ``x-pg-region`` wins over ``pg_metadata.region``: after a failover it is the region that ran the
    request as relayed by the one that forwarded it, and it is on error responses too.
    """
    header_metrics = parse_server_timing(headers.get("server-timing"))
    fields: dict[str, Any] = {_HEADER_FIELDS[k]: v for k, v in header_metrics.items() if k in _HEADER_FIELDS}
    fields.update({k: v for k, v in (metadata or {}).items() if v is not None})
    fields["region"] = headers.get(REGION_HEADER) or fields.get("region")
    fields["failover_from"] = headers.get(FAILOVER_FROM_HEADER)
    fields["trace_id"] = fields.get("trace_id") or trace_id
    fields["server_timing"] = header_metrics
    return ServerTiming.model_validate(fields)


def new_traceparent(sample_ratio: float) -> str:
    """A W3C traceparent for a new trace: random ids, sampled with probability ``sample_ratio``.

    The server does not follow the flag: its region records a share of traces chosen by their
    trace id (``serve_app/telemetry/tracing.py``, ``region_sampler``), since anyone can set it. The
    flag is for the caller's own tracing, which may follow it.
    """
    trace_id = secrets.token_hex(16)
    span_id = secrets.token_hex(8)
    # All-zero ids are invalid (W3C trace-context §3.2.2); 2**-128 odds, still handled.
    if set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return new_traceparent(sample_ratio)
    flags = "01" if random.random() < sample_ratio else "00"
    return f"00-{trace_id}-{span_id}-{flags}"


def trace_id_of(traceparent: str) -> str:
    """The trace id in a traceparent; ValueError if it is not a version-00 W3C traceparent."""
    match = _TRACEPARENT.match(traceparent.strip().lower())
    if match is None:
        raise ValueError("traceparent must look like 00-<32 hex>-<16 hex>-<2 hex>")
    return match.group(1)
