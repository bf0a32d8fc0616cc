"""Interleaved rounds: the same workload against each side in turn, never both at once.

``plan_batches`` decides the order (pure, tested on its own); ``run_plan`` carries it out with a
pool of ``concurrency`` workers per batch and a quiet pause before every batch.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from serve_app.bench.client import Run

Request = Callable[[], Awaitable[Run]]
OURS, BASELINE = "ours", "baseline"  # the side names every table and file uses


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


def auto_round_size(concurrency: int) -> int:
    """Two requests per worker, at least 10: long enough to reach steady state, short enough that
    drift on the machine (another job, thermal) lands on both sides alike."""
    return max(concurrency * 2, 10)


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

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0 and (deadline is None or time.perf_counter() < deadline):
            remaining -= 1
            results.append(await _safe(request))
            if on_done:
                on_done()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, size))))
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
) -> dict[str, SideRuns]:
    """Run the batches in order; ``budget_s`` caps each side's counted wall time."""
    results = {side: SideRuns() for side in requests}
    for batch in plan:
        side = results[batch.side]
        left = None if budget_s is None or not batch.counted else budget_s - side.wall_s
        if left is not None and left <= 0:
            continue
        # A just-busy engine keeps spinning (busy-polling, finishing its step) for a while; the
        # pause lets it go idle so this batch does not share the cores with the last one's tail.
        await sleep(quiet_s)
        deadline = None if left is None else time.perf_counter() + left
        tick = (lambda name=batch.side: on_done(name)) if on_done else None
        runs, wall_s = await run_batch(requests[batch.side], batch.size, concurrency, tick, deadline)
        if batch.counted:
            side.runs += runs
            side.wall_s += wall_s
            side.batches += 1
    return results


def collect(
    done: Mapping[str, SideRuns],
    summarize: Callable[[list[Run], float], dict],
    ratios: Callable[[dict, dict], dict],
) -> dict:
    """Per side: summary, batch count and raw runs; plus ours-vs-baseline ratios when both ran."""
    entry: dict = {
        name: {"summary": summarize(r.runs, r.wall_s), "batches": r.batches, "runs": [asdict(x) for x in r.runs]}
        for name, r in done.items()
    }
    if OURS in entry and BASELINE in entry:
        entry["ratios"] = ratios(entry[OURS]["summary"], entry[BASELINE]["summary"])
    return entry
