"""Interleaved rounds: the same workload against each side in turn, never both at once.

``plan_batches`` decides the order (pure, tested on its own); ``run_plan`` carries it out with a
pool of ``concurrency`` workers per batch and a quiet pause before every batch: ``quiet_s`` of
sleep, then, with a ``Meter`` (``serve_app.bench.cpu``), the measured wait until the host is
idle, and the batch's CPU-seconds per process; with ``Alone`` (``serve_app.bench.alone``), the
other side's server stopped meanwhile.
"""

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.bench.alone import Alone
from serve_app.bench.client import Run
from serve_app.bench.cpu import Meter, measured, steady_cpu
from serve_app.bench.procs import BASELINE, OURS
from serve_app.bench.stats import percentile, sustained, tokens_between

Request = Callable[[], Awaitable[Run]]
__all__ = ["BASELINE", "OURS", "Batch", "SideRuns", "collect", "plan_batches", "run_batch", "run_plan"]


@dataclass(frozen=True)
class Batch:
    side: str
    size: int
    counted: bool  # False: a warm-up batch, run but not measured


@dataclass
class SideRuns:
    runs: list[Run] = field(default_factory=list)
    wall_s: float = 0.0  # summed wall time of the side's counted batches
    batches: int = 0
    # One per counted batch: round, requests, tokens, wall and sustained window, quiet, CPU (the
    # whole batch's, and its steady-load window's), the median TTFT of its successful streams.
    records: list[dict[str, Any]] = field(default_factory=list)


def plan_batches(sides: Sequence[str], runs: int, round_size: int, warmup: int) -> list[Batch]:
    """One warm-up batch per side, then rounds of ``round_size`` until ``runs`` per side.

    Each round runs every side once; the order flips every round (A,B then B,A…) so whatever
    favours going first or second (a warmer cache, a machine still busy) cancels out.
    """
    if round_size < 1:
        raise ValueError("round_size must be at least 1")
    order = [Batch(side, warmup, counted=False) for side in sides if warmup > 0]
    done, flipped = 0, False
    while done < runs:
        size = min(round_size, runs - done)
        order += [Batch(side, size, counted=True) for side in (reversed(sides) if flipped else sides)]
        done, flipped = done + size, not flipped
    return order


async def _safe(request: Request) -> Run:
    try:
        return await request()
    except Exception as err:  # a bug or an odd answer must cost one run, not the whole benchmark
        return Run(ok=False, error=f"client error: {type(err).__name__}", detail=str(err)[:200])


async def run_batch(
    request: Request,
    size: int,
    concurrency: int,
    on_done: Callable[[], None] | None = None,
    deadline: float | None = None,
) -> tuple[list[Run], float]:
    """``size`` requests by ``concurrency`` workers (each starts its next as its last ends), and
    the batch's wall time. ``deadline`` (perf_counter): start no request after it."""
    results: list[Run] = []
    remaining = size

    async def worker(index: int) -> None:
        nonlocal remaining
        while remaining > 0 and (deadline is None or time.perf_counter() < deadline):
            remaining -= 1
            run = await _safe(request)
            run.worker = index
            results.append(run)
            if on_done:
                on_done()

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(min(concurrency, size))))
    return results, time.perf_counter() - started


async def run_plan(
    plan: Sequence[Batch],
    requests: Mapping[str, Request],
    concurrency: int,
    quiet_s: float,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_done: Callable[[str], None] | None = None,
    budget_s: float | None = None,
    meter: Meter | None = None,
    batch_s: float | None = None,
    alone: Alone | None = None,
) -> dict[str, SideRuns]:
    """Run the batches in order; ``budget_s`` caps each side's counted wall time; ``batch_s``
    makes each counted batch last that long (workers start no request after it) instead of
    ``batch.size`` requests; ``alone``: the other side's server stopped during each batch and
    the quiet around it. Counted batch i belongs to round i // (number of sides)."""
    results = {side: SideRuns() for side in requests}
    counted = 0
    for batch in plan:
        side = results[batch.side]
        left = None if budget_s is None or not batch.counted else budget_s - side.wall_s
        if left is not None and left <= 0:
            continue
        limits = [x for x in (left, batch_s if batch.counted else None) if x is not None]
        size = batch.size if not (batch_s and batch.counted) else 2**31
        tick = (lambda name=batch.side: on_done(name)) if on_done else None

        def one_batch(size=size, tick=tick, limits=limits):
            deadline = time.perf_counter() + min(limits) if limits else None
            return run_batch(requests[batch.side], size, concurrency, tick, deadline)

        samples = []
        with alone.running(batch.side) if alone else contextlib.nullcontext():
            # A just-busy engine keeps spinning (busy-polling, finishing its step) for a while; the
            # pause lets it go idle so this batch does not share the cores with the last one's tail.
            await sleep(quiet_s)
            quiet = await meter.wait_quiet(batch.side) if meter else None
            if meter:
                (runs, wall_s), cpu, samples = await measured(meter, one_batch, batch.side)
            else:
                (runs, wall_s), cpu = await one_batch(), None
        if batch.counted:
            window = sustained(runs)
            steady = None
            if meter:
                steady = steady_cpu(meter, samples, window, functools.partial(tokens_between, runs))
            side.runs += runs
            side.wall_s += wall_s
            side.batches += 1
            side.records.append({
                "round": counted // len(requests), "side": batch.side, "requests": len(runs),
                "ok": sum(r.ok for r in runs), "completion_tokens": sum(r.completion_tokens for r in runs if r.ok),
                "wall_s": wall_s, "sustained": window, "quiet": quiet, "cpu": cpu, "steady_cpu": steady,
                # for the round's paired TTFT overhead (``stats.round_ratios``)
                "ttft_p50_ms": percentile((r.ttft_ms for r in runs if r.ok), 50),
            })
            counted += 1
    return results


def collect(
    done: Mapping[str, SideRuns],
    summarize: Callable[[list[Run], float], dict],
    ratios: Callable[[dict, dict], dict],
) -> dict:
    """Per side: summary, batch count and raw runs; plus ours-vs-baseline ratios when both ran."""
    entry: dict = {
        name: {"summary": summarize(r.runs, r.wall_s), "batches": r.batches, "runs": [x.record() for x in r.runs]}
        for name, r in done.items()
    }
    if OURS in entry and BASELINE in entry:
        entry["ratios"] = ratios(entry[OURS]["summary"], entry[BASELINE]["summary"])
    return entry
