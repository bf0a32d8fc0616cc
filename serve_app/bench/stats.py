"""Percentiles, per-side summaries and ours-vs-baseline ratios (definitions: ``serve_app.bench``)."""

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from serve_app.bench.client import Run
from serve_app.bench.procs import BASELINE, OURS

# A batch beside which processes of neither side used more than this (cores, on average) did not
# have the host to itself, and its round is left out of the ratios: 99 % of the 2,142 batches
# committed before 2026-12-07 stayed under 0.20, 95 % under 0.05; the ones above ran beside
# another job (a test suite, a build).
OUTSIDE_CORES = 0.15


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
    summary["admission"] = dict(Counter(step for r in good for step in r.admission))  # answers per step
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


# --- sustained load and the spread over rounds --------------------------------------------------
def sustained(runs: Sequence[Run]) -> dict[str, float] | None:
    """The batch's steady state: tokens and seconds from the moment the *last* worker got its
    first token (every worker is streaming: ramp-up over) to the moment the *first* worker ended
    its last request (from then on fewer than ``concurrency`` streams are in flight: the tail).

    Each worker sends its next request as its last one ends, so in between exactly
    ``concurrency`` requests are in flight, prefills of the next requests included, as a server
    under steady load sees them. Tokens are the successful streams' chunks that arrived inside
    the window, each counted as completion_tokens / chunks of its stream (1 with vLLM's one
    token per chunk). None when there is no such window (a worker that never streamed, or the
    first one done before the last one started).
    """
    workers: dict[int, list[Run]] = {}
    for run in runs:
        if run.worker is not None:
            workers.setdefault(run.worker, []).append(run)
    if not workers:
        return None
    firsts, lasts = [], []
    for own in workers.values():
        first = [r.token_times[0] for r in own if r.ok and r.token_times]
        ended = [r.ended_at for r in own if r.ended_at is not None]
        if not first or not ended:
            return None
        firsts.append(min(first))
        lasts.append(max(ended))
    start, end = max(firsts), min(lasts)
    if end <= start:
        return None
    tokens = tokens_between(runs, start, end)
    return {"seconds": end - start, "tokens": tokens, "tokens_per_s": tokens / (end - start),
            "start": start, "end": end}


def tokens_between(runs: Sequence[Run], start: float, end: float) -> float:
    """Completion tokens of the successful streams whose chunks arrived in [start, end] (client
    clock), each chunk counted as completion_tokens / chunks of its stream."""
    tokens = 0.0
    for run in runs:
        if run.ok and run.token_times:
            inside = sum(start <= t <= end for t in run.token_times)
            tokens += inside * run.completion_tokens / len(run.token_times)
    return tokens


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    """Median (the usual one: the mean of the middle two for an even count) and range."""
    present = [v for v in values if v is not None]
    if not present:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(present), "median": statistics.median(present), "min": min(present), "max": max(present)}


def batch_rate(batch: Mapping[str, Any], sustained: bool = True) -> tuple[float | None, str]:
    """A counted batch's tokens/s: the sustained window's (unless ``sustained`` is False), else
    the whole batch's (said which)."""
    window = batch.get("sustained")
    if sustained and window and window.get("tokens_per_s"):
        return window["tokens_per_s"], "sustained"
    wall = batch.get("wall_s") or 0
    return (batch["completion_tokens"] / wall if wall > 0 else None), "batch"


def round_ratios(batches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per round (one batch of each side, run back to back): ours / baseline tokens/s and
    CPU-seconds per 1,000 tokens, and ours − baseline TTFT p50 in ms; then their median and range
    over the rounds. The TTFT difference is paired: the two batches of a round ran minutes apart
    at most, so the host's drift between rounds (its speed moves by a third within a session here)
    cancels out of it, where the difference of the two sides' overall p50s keeps it.

    A round is left out of the median and range, and says why (``excluded``), when one of its
    batches shared the host with something else (``OUTSIDE_CORES``) or has no rate; ``rounds``
    counts every round run, so a reader (the gate) sees how many the figures stand on. Failed
    requests are counted per round (``errors``): a refusal takes no time, so a side refusing
    half its requests can keep its tokens/s."""
    by_round: dict[int, dict[str, Mapping[str, Any]]] = {}
    for batch in batches:
        by_round.setdefault(batch["round"], {})[batch["side"]] = batch
    rounds = []
    for number in sorted(by_round):
        pair = by_round[number]
        if OURS not in pair or BASELINE not in pair:  # counted in ``rounds_run``, nothing to pair
            continue
        (ours, basis_o), (base, basis_b) = batch_rate(pair[OURS]), batch_rate(pair[BASELINE])
        basis = "sustained" if basis_o == basis_b == "sustained" else "batch"
        if basis == "batch":  # one side without a sustained window: both on the whole batch, alike
            ours, base = (batch_rate(pair[side], sustained=False)[0] for side in (OURS, BASELINE))
        cpu = {side: _own_cpu_per_1k(pair[side]) for side in (OURS, BASELINE)}
        steady = {side: _steady_cpu_per_1k(pair[side]) for side in (OURS, BASELINE)}
        ttft = {side: pair[side].get("ttft_p50_ms") for side in (OURS, BASELINE)}  # absent in older files
        outside = max((c for side in (OURS, BASELINE) if (c := _outside_cores(pair[side])) is not None), default=None)
        ratio, excluded = _ratio(ours, base), None
        if outside is not None and outside > OUTSIDE_CORES:
            excluded = f"another process used {outside:.2f} cores beside a batch"
        elif ratio is None:
            excluded = "a side had no tokens"
        rounds.append({
            "round": number, "ours_tokens_per_s": ours, "baseline_tokens_per_s": base,
            "tokens_per_s_ratio": ratio, "basis": basis, "outside_cores": outside, "excluded": excluded,
            "errors": sum(pair[side]["requests"] - pair[side]["ok"] for side in (OURS, BASELINE)
                          if "requests" in pair[side] and "ok" in pair[side]),
            "ours_cpu_per_1k": cpu[OURS], "baseline_cpu_per_1k": cpu[BASELINE],
            "cpu_ratio": _ratio(cpu[OURS], cpu[BASELINE]),
            "ours_steady_cpu_per_1k": steady[OURS], "baseline_steady_cpu_per_1k": steady[BASELINE],
            "steady_cpu_ratio": _ratio(steady[OURS], steady[BASELINE]),
            "ours_ttft_p50_ms": ttft[OURS], "baseline_ttft_p50_ms": ttft[BASELINE],
            "ttft_overhead_ms": _difference(ttft[OURS], ttft[BASELINE]),
        })
    kept = [r for r in rounds if not r["excluded"]]
    return {"rounds": rounds, "rounds_run": len(by_round), "errors": sum(r["errors"] for r in rounds),
            "tokens_per_s_ratio": spread(r["tokens_per_s_ratio"] for r in kept),
            "cpu_ratio": spread(r["cpu_ratio"] for r in kept),
            "steady_cpu_ratio": spread(r["steady_cpu_ratio"] for r in kept),
            "ttft_overhead_ms": spread(r["ttft_overhead_ms"] for r in kept)}


def _outside_cores(batch: Mapping[str, Any]) -> float | None:
    return (batch.get("cpu") or {}).get("host_other_cores")


def _difference(ours: float | None, baseline: float | None) -> float | None:
    return None if ours is None or baseline is None else ours - baseline


def _own_cpu_per_1k(batch: Mapping[str, Any]) -> float | None:
    """The batch's side's CPU-seconds per 1,000 tokens over the whole batch."""
    cpu = batch.get("cpu")
    return _side_cpu_per_1k(batch, cpu, batch["completion_tokens"]) if cpu else None


def _steady_cpu_per_1k(batch: Mapping[str, Any]) -> float | None:
    """The same over the sustained window only (``steady_cpu``: its own token count)."""
    steady = batch.get("steady_cpu")
    return _side_cpu_per_1k(batch, steady, steady["tokens"]) if steady else None


def _side_cpu_per_1k(batch: Mapping[str, Any], cpu: Mapping[str, Any], tokens: float) -> float | None:
    if not tokens:
        return None
    return 1000 * cpu["sides"].get(batch["side"], {}).get("total", 0.0) / tokens


def sustained_tokens_per_s(batches: Sequence[Mapping[str, Any]]) -> float | None:
    """A side's sustained tokens/s over all its counted batches (summed tokens / summed seconds)."""
    windows = [b["sustained"] for b in batches if b.get("sustained")]
    seconds = sum(w["seconds"] for w in windows)
    return sum(w["tokens"] for w in windows) / seconds if seconds > 0 else None
