"""Router capacity: sustained requests/s the server answers when the engine is not the bottleneck.

Two workloads, each against every side in interleaved rounds (``serve_app.bench.schedule``):

- ``models``: authenticated ``GET /v1/models`` — auth, model states, JSON; no engine at all;
- ``chat``: non-streaming chat completions with ``max_tokens: 1`` — the whole request path with
  the least engine work (one prefill of the short prompt, one token).

Per workload and side: requests/s = successful requests / the side's summed batch wall time,
latency p50/p95 (nearest rank, client clock, whole response), errors by reason. Bounded by count
(``requests``) and, per side and workload, by ``duration_s`` of counted wall time.
"""

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import httpx

from serve_app.bench.client import ROUTE_CHAT, ROUTE_MODELS, Side, call_once, chat_body, side_clients
from serve_app.bench.report import errors_cell, fmt, fmt_overhead
from serve_app.bench.schedule import BASELINE, OURS, Request, collect, plan_batches, run_plan
from serve_app.bench.stats import capacity_ratios, summarize_calls
from serve_app.bench.streams import Progress

DEFAULT_REQUESTS = {"models": 500, "chat": 100}
CAPACITY_HEADERS = ["workload", "side", "requests", "throughput", "latency p50", "latency p95", "errors"]


def capacity_round_size(concurrency: int) -> int:
    """Calls are short, so rounds are longer than for streams: fewer pauses per measured second."""
    return max(concurrency * 4, 20)


def _request(workload: str, client: httpx.AsyncClient, side: Side) -> Request:
    if workload == "models":
        return partial(call_once, client, "GET", side.url + ROUTE_MODELS)
    return partial(call_once, client, "POST", side.url + ROUTE_CHAT, chat_body(side.model, 1, stream=False))


async def bench_capacity(
    sides: Sequence[Side],
    *,
    concurrency: int = 16,
    requests: Mapping[str, int] = DEFAULT_REQUESTS,
    round_size: int | None = None,
    warmup: int = 1,
    quiet_s: float = 2.0,
    duration_s: float | None = 60.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """``{"<workload>": {"<side>": {"summary", "batches", "runs"}, "ratios": …}}``."""
    results: dict[str, Any] = {}
    async with side_clients(sides, concurrency, transport) as clients:
        for workload, count in requests.items():
            calls = {side.name: _request(workload, clients[side.name], side) for side in sides}
            plan = plan_batches(list(calls), count, round_size or capacity_round_size(concurrency), warmup * concurrency)
            tick = progress(workload, sum(b.size for b in plan)) if progress else None
            done = await run_plan(plan, calls, concurrency, quiet_s, sleep=sleep, on_done=tick, budget_s=duration_s)
            results[workload] = collect(done, summarize_calls, capacity_ratios)
    return results


def capacity_table(results: Mapping[str, Any]) -> list[list[str]]:
    """Rows under ``CAPACITY_HEADERS``: one per workload and side, then ours / baseline."""
    rows = []
    for workload, entry in results.items():
        for name in (OURS, BASELINE):
            if name in entry:
                s = entry[name]["summary"]
                rows.append([workload, name, str(s["runs"]), fmt(s["requests_per_s"], " req/s"),
                             fmt(s["latency_ms_p50"], " ms"), fmt(s["latency_ms_p95"], " ms"), errors_cell(s)])
        if "ratios" in entry:
            r = entry["ratios"]
            rows.append([workload, "ours / baseline", "", fmt(r["requests_per_s"], "×", 2),
                         fmt_overhead(r["latency_overhead_p50"]), fmt_overhead(r["latency_overhead_p95"]), ""])
    return rows
