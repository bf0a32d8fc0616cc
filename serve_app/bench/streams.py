"""The streaming benchmark's driver: every concurrency, every side, interleaved (see the package doc)."""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import httpx

from serve_app.bench.client import Side, chat_body, check_local, side_clients, stream_once
from serve_app.bench.schedule import auto_round_size, collect, plan_batches, run_plan
from serve_app.bench.stats import stream_ratios, summarize

# progress(label, total) → tick(side): the CLI's progress bar, or nothing.
Progress = Callable[[str, int], Callable[[str], None]]


async def bench_streams(
    sides: Sequence[Side],
    concurrencies: Sequence[int],
    *,
    runs: int,
    max_tokens: int,
    ignore_eos: bool = False,
    round_size: int | None = None,
    warmup: int = 1,
    quiet_s: float = 2.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """``{"<concurrency>": {"<side>": {"summary", "batches", "runs"}, "ratios": …}}``.

    ``runs`` counted streams per side per concurrency; ``warmup`` uncounted requests per worker
    (so every connection and engine slot has been used once before measuring).
    """
    results: dict[str, Any] = {}
    async with side_clients(sides, max(concurrencies), transport) as clients:
        for concurrency in concurrencies:
            requests = {
                side.name: partial(stream_once, clients[side.name], side.url,
                                   chat_body(side.model, max_tokens, ignore_eos=ignore_eos))
                for side in sides
            }
            plan = plan_batches(list(requests), runs, round_size or auto_round_size(concurrency), warmup * concurrency)
            tick = progress(f"c={concurrency}", sum(b.size for b in plan)) if progress else None
            done = await run_plan(plan, requests, concurrency, quiet_s, sleep=sleep, on_done=tick)
            results[str(concurrency)] = collect(done, summarize, stream_ratios)
    return results


def bench_target(
    url: str, model: str, runs: int, max_tokens: int, warmup: int, api_key: str | None = None
) -> dict[str, Any]:
    """``runs`` sequential streams against one target (concurrency 1, no pauses), as
    ``serve_app.bench.failover`` compares two targets: ``{"url", "summary", "runs"}``."""
    side = Side("target", check_local(url), model, api_key)
    result = asyncio.run(
        bench_streams([side], [1], runs=runs, max_tokens=max_tokens, round_size=max(runs, 1), warmup=warmup, quiet_s=0)
    )
    entry = result["1"]["target"]
    return {"url": url, "summary": entry["summary"], "runs": entry["runs"]}
