"""The streaming benchmark's driver: every concurrency, every side, interleaved (see the package doc)."""

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import httpx

from serve_app.bench.alone import Alone
from serve_app.bench.client import Side, chat_body, check_local, side_clients, stream_once
from serve_app.bench.cpu import Meter, per_1k_tokens
from serve_app.bench.schedule import BASELINE, OURS, SideRuns, collect, plan_batches, run_plan
from serve_app.bench.stats import round_ratios, stream_ratios, summarize, sustained_tokens_per_s

REQUESTS_PER_WORKER = 5  # back to back per worker per batch: sustained load, not ramp-up and tail
ROUNDS = 5  # per concurrency: enough for a median and a range of the ratio

# progress(label, total) → tick(side): the CLI's progress bar, or nothing.
Progress = Callable[[str, int], Callable[[str], None]]


async def bench_streams(
    sides: Sequence[Side],
    concurrencies: Sequence[int],
    *,
    runs: int | None,
    max_tokens: int,
    ignore_eos: bool = False,
    round_size: int | None = None,
    warmup: int = 1,
    quiet_s: float = 2.0,
    rounds: int = ROUNDS,
    requests_per_worker: int = REQUESTS_PER_WORKER,
    batch_s: float | None = None,
    meter: Meter | None = None,
    alone: Alone | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    progress: Progress | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """``{"<concurrency>": {"<side>": {"summary", "batches", "rounds", "runs"}, "ratios", "spread", "cpu"}}``.

    Each round is one batch per side of ``round_size`` requests (default ``requests_per_worker``
    × concurrency: every worker sends that many back to back), or of ``batch_s`` seconds;
    ``rounds`` rounds, or as many as ``runs`` counted streams per side take. ``warmup``
    uncounted requests per worker first (every connection and engine slot used once). ``alone``:
    the side not measured is stopped meanwhile (``serve_app.bench.alone``).
    """
    results: dict[str, Any] = {}
    async with side_clients(sides, max(concurrencies), transport) as clients:
        for concurrency in concurrencies:
            requests = {
                side.name: partial(stream_once, clients[side.name], side.url,
                                   chat_body(side.model, max_tokens, ignore_eos=ignore_eos))
                for side in sides
            }
            size = 1 if batch_s else (round_size or requests_per_worker * concurrency)
            if size < concurrency and not batch_s:  # fewer workers than the concurrency reported
                raise ValueError(f"a batch of {size} requests cannot keep {concurrency} streams in flight; "
                                 f"give --round-size of at least {concurrency}")
            # whole batches only: a last short one would be a round at a lower concurrency
            counted = -(-runs // size) * size if runs is not None and not batch_s else rounds * size
            plan = plan_batches(list(requests), counted, size, warmup * concurrency)
            total = None if batch_s else sum(b.size for b in plan)
            tick = progress(f"c={concurrency}", total) if progress else None
            done = await run_plan(plan, requests, concurrency, quiet_s, sleep=sleep, on_done=tick, meter=meter,
                                  batch_s=batch_s, alone=alone)
            results[str(concurrency)] = level_results(done)
    return results


def level_results(done: dict[str, SideRuns]) -> dict[str, Any]:
    """One concurrency's entry: per side the summary (with the sustained rate), its batches'
    records and raw runs; the ratios, their spread over rounds, and the CPU per 1,000 tokens."""
    entry = collect(done, summarize, stream_ratios)
    batches = [record for side in done.values() for record in side.records]
    for name, side in done.items():
        entry[name]["summary"]["sustained_tokens_per_s"] = sustained_tokens_per_s(side.records)
        entry[name]["rounds"] = side.records
    if OURS in entry and BASELINE in entry:
        ours, base = (entry[s]["summary"]["sustained_tokens_per_s"] for s in (OURS, BASELINE))
        entry["ratios"]["sustained_tokens_per_s"] = ours / base if ours is not None and base else None
        entry["spread"] = round_ratios(batches)
    if any(b.get("cpu") for b in batches):
        entry["cpu"] = per_1k_tokens(batches)
    return entry


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
