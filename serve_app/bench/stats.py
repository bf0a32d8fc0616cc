"""Percentiles, per-side summaries and ours-vs-baseline ratios (definitions: ``serve_app.bench``)."""

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from serve_app.bench.client import Run


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Nearest-rank percentile: the value at index ceil(q/100 · n) − 1 of the sorted values.

    Always one of the measured values (no interpolation), the usual definition for latency
    tables; ``statistics.quantiles`` would invent values between two runs.
    """
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return None
    index = math.ceil(q * len(ordered) / 100) - 1  # q·n/100, not q/100·n: 0.95·100 is not 95.0
    return ordered[min(max(index, 0), len(ordered) - 1)]


def server_ttft_ms(server: Mapping[str, Any]) -> float | None:
    """Server-only TTFT from a ``pg_metadata``: ``queue_ms`` (waiting) + ``inference_ttft_ms`` (prefill)."""
    prefill = server.get("inference_ttft_ms")
    return None if prefill is None else prefill + (server.get("queue_ms") or 0.0)


def _errors(runs: list[Run]) -> dict[str, Any]:
    failed = [r.error or "unknown" for r in runs if not r.ok]
    return {"runs": len(runs), "ok": len(runs) - len(failed), "errors": len(failed), "error_reasons": dict(Counter(failed))}


def _p(values: list[float | None]) -> tuple[float | None, float | None]:
    return percentile(values, 50), percentile(values, 95)


def summarize(runs: list[Run], wall_s: float) -> dict[str, Any]:
    """One side at one concurrency; ``wall_s`` is the summed wall time of its counted batches."""
    good = [r for r in runs if r.ok]
    server = [server_ttft_ms(r.server) for r in good]
    overhead = [r.ttft_ms - s for r, s in zip(good, server) if s is not None and r.ttft_ms is not None]
    tokens = sum(r.completion_tokens for r in good)
    summary = _errors(runs)
    summary["ttft_ms_p50"], summary["ttft_ms_p95"] = _p([r.ttft_ms for r in good])
    summary["server_ttft_ms_p50"], summary["server_ttft_ms_p95"] = _p(server)
    summary["network_overhead_ms_p50"], summary["network_overhead_ms_p95"] = _p(overhead)
    summary["total_ms_p50"], summary["total_ms_p95"] = _p([r.total_ms for r in good])
    summary["decode_tokens_per_s_p50"] = percentile([r.decode_tokens_per_s for r in good], 50)
    summary["completion_tokens"] = tokens
    summary["wall_s"] = wall_s
    summary["aggregate_tokens_per_s"] = tokens / wall_s if wall_s > 0 else None
    # The rest of the server's split, where it sends one (p50 of each field).
    for key in ("queue_ms", "network_ms", "server_ms", "inference_total_ms"):
        summary[f"pg_{key}_p50"] = percentile([r.server.get(key) for r in good], 50)
    return summary


def summarize_calls(runs: list[Run], wall_s: float) -> dict[str, Any]:
    """Router capacity: successful requests per second over the side's wall time, and latency."""
    summary = _errors(runs)
    summary["latency_ms_p50"], summary["latency_ms_p95"] = _p([r.total_ms for r in runs if r.ok])
    summary["wall_s"] = wall_s
    summary["requests_per_s"] = summary["ok"] / wall_s if wall_s > 0 else None
    return summary


def _ratio(ours: float | None, baseline: float | None) -> float | None:
    return ours / baseline if ours is not None and baseline else None


def _overhead(ours: Mapping[str, Any], baseline: Mapping[str, Any], key: str) -> dict[str, float | None]:
    a, b = ours.get(key), baseline.get(key)
    diff = a - b if a is not None and b is not None else None
    return {"ms": diff, "pct": 100 * diff / b if diff is not None and b else None}


def stream_ratios(ours: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """Ours / baseline throughput (1.0 = parity) and what ours adds to TTFT (ms and % of baseline)."""
    return {
        "aggregate_tokens_per_s": _ratio(ours.get("aggregate_tokens_per_s"), baseline.get("aggregate_tokens_per_s")),
        "decode_tokens_per_s_p50": _ratio(ours.get("decode_tokens_per_s_p50"), baseline.get("decode_tokens_per_s_p50")),
        "ttft_overhead_p50": _overhead(ours, baseline, "ttft_ms_p50"),
        "ttft_overhead_p95": _overhead(ours, baseline, "ttft_ms_p95"),
    }


def capacity_ratios(ours: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "requests_per_s": _ratio(ours.get("requests_per_s"), baseline.get("requests_per_s")),
        "latency_overhead_p50": _overhead(ours, baseline, "latency_ms_p50"),
        "latency_overhead_p95": _overhead(ours, baseline, "latency_ms_p95"),
    }
