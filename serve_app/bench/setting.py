"""``serve-app bench-setting``: one router setting at two (or more) values, taking turns on one
running service: what it changes in each process's CPU per 1,000 tokens, in tokens/s, and in the
time to first token.

Two services cannot run side by side on a small host (both engines would pin the same cores:
docs/benchmarks.md), so the values take turns on the one running service. Before each batch the
Router's ``user_config`` gets the value (``serve deploy`` of the config with it: Serve applies a
``user_config`` in place, ``reconfigure`` on the running router replicas, nothing restarts), the
service is left to go quiet, and the batch runs: ``concurrency`` workers, each
``requests_per_worker`` streams back to back. The values' order turns every round (A B, B A, …),
so a drift of the host over the run falls on both. CPU is counted per process of the cluster as
``serve-app bench`` counts it (``cpu.Meter``); the summary is the mean over rounds per value, and
the TTFT percentiles of all its counted streams (a setting on the request's way to the engine shows
there first: at one stream, a handle's transport is milliseconds of a ~25 ms TTFT).
"""

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from serve_app.bench.client import chat_body, stream_once
from serve_app.bench.cpu import Meter
from serve_app.bench.procs import OURS
from serve_app.bench.stats import percentile
from serve_app.regions.layout import ROUTER_DEPLOYMENT


def config_with(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of a ``serve deploy`` config whose Router ``user_config`` has ``value`` at ``path``
    (dotted: ``router.hand_off_streams``). ValueError when the config has no Router deployment."""
    out = copy.deepcopy(config)
    for app in out.get("applications") or ():
        for deployment in app.get("deployments") or ():
            if deployment.get("name") == ROUTER_DEPLOYMENT:
                node = deployment.setdefault("user_config", {})
                *parents, leaf = path.split(".")
                for key in parents:
                    node = node.setdefault(key, {})
                    if not isinstance(node, dict):
                        raise ValueError(f"{path}: {key} is not a mapping in the Router's user_config")
                node[leaf] = value
                return out
    raise ValueError(f"the config has no {ROUTER_DEPLOYMENT} deployment")


def order(values: Sequence[Any], round_index: int) -> list[Any]:
    """The values in turn, reversed every other round."""
    return list(values) if round_index % 2 == 0 else list(reversed(values))


async def batch(url: str, api_key: str | None, body: dict[str, Any], concurrency: int,
                requests_per_worker: int, transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    """``concurrency`` workers streaming ``requests_per_worker`` requests each: tokens, wall time, errors."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=600, transport=transport) as client:
        async def worker() -> list:
            return [await stream_once(client, url, body) for _ in range(requests_per_worker)]

        started = time.perf_counter()
        runs = [run for runs in await asyncio.gather(*(worker() for _ in range(concurrency))) for run in runs]
        wall_s = time.perf_counter() - started
    tokens = sum(run.completion_tokens for run in runs if run.ok)
    errors = [run.error for run in runs if not run.ok]
    return {"tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s if wall_s else None,
            "requests": len(runs), "errors": errors, "ttft_ms": [run.ttft_ms for run in runs if run.ok]}


async def bench_setting(
    *, url: str, api_key: str | None, model: str, path: str, values: Sequence[Any], concurrency: int,
    requests_per_worker: int, rounds: int, max_tokens: int, ignore_eos: bool,
    apply: Callable[[Any], Awaitable[None]], meter: Meter | None,
    progress: Callable[[str], None] = lambda _line: None, transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """Every batch (``apply(value)`` first, one uncounted request per worker, then the counted
    batch between two CPU snapshots) and the summary per value."""
    body = chat_body(model, max_tokens, ignore_eos=ignore_eos)
    batches = []
    for round_index in range(rounds):
        for value in order(values, round_index):
            await apply(value)
            await batch(url, api_key, body, concurrency, 1, transport)  # warm: connections, the new settings
            if meter is not None:
                await meter.wait_quiet()
                before = meter.snapshot()
            result = await batch(url, api_key, body, concurrency, requests_per_worker, transport)
            if meter is not None:
                await meter.wait_quiet()
                cpu = meter.cpu_between(before, meter.snapshot())
                own = cpu["sides"].get(OURS, {"total": 0.0, "groups": {}})
                if result["tokens"]:  # none: no CPU per token either (not 0, which would read cheapest)
                    per_1k = 1000 / result["tokens"]
                    result["cpu_per_1k"] = {group: used * per_1k for group, used in own["groups"].items()}
                    result["cpu_per_1k"]["whole service"] = own["total"] * per_1k
            batches.append({"round": round_index, "value": value, **result})
            progress(f"round {round_index} {path}={value!r}: {result['tok_s'] or 0:.1f} tok/s, "
                     f"{len(result['errors'])} errors")
    return {"setting": path, "values": list(values), "concurrency": concurrency, "rounds": rounds,
            "requests_per_worker": requests_per_worker, "max_tokens": max_tokens, "batches": batches,
            "summary": summary(batches, values)}


def summary(batches: Sequence[dict[str, Any]], values: Sequence[Any]) -> list[dict[str, Any]]:
    """Per value: mean tok/s and mean CPU-seconds per 1,000 tokens per process group over its
    batches without a failed request (a failure takes no time and no tokens: such a batch reads
    cheaper and no slower, ``batches_used`` says how many are left); TTFT p50 and p95 over all
    its counted streams."""
    out = []
    for value in values:
        mine = [b for b in batches if b["value"] == value]
        used = [b for b in mine if b["tokens"] and not b["errors"]]
        groups = sorted({g for b in used for g in b.get("cpu_per_1k", {})})
        ttfts = [ttft for b in mine for ttft in b.get("ttft_ms", ())]
        out.append({
            "value": value, "batches": len(mine), "batches_used": len(used),
            "tok_s": _mean([b["tok_s"] for b in used]),
            "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p95": percentile(ttfts, 95),
            "errors": sum(len(b["errors"]) for b in mine),
            "cpu_per_1k": {g: _mean([b["cpu_per_1k"][g] for b in used if g in b.get("cpu_per_1k", {})])
                           for g in groups},
        })
    return out


def _mean(numbers: Sequence[float]) -> float | None:
    return sum(numbers) / len(numbers) if numbers else None


def summary_table(result: dict[str, Any]) -> str:
    """The summary as Markdown: one row per process group, one column per value."""
    rows = result["summary"]
    groups = sorted({g for row in rows for g in row["cpu_per_1k"]}, key=lambda g: (g == "whole service", g))
    head = "| CPU-s per 1,000 tokens | " + " | ".join(f"{result['setting']}={row['value']!r}" for row in rows) + " |"
    lines = [head, "|---|" + "---|" * len(rows)]
    for group in groups:
        cells = [f"{row['cpu_per_1k'][group]:.3f}" if row["cpu_per_1k"].get(group) is not None else "—" for row in rows]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines.append("| tok/s (mean) | " + " | ".join(f"{row['tok_s']:.1f}" if row["tok_s"] else "—" for row in rows) + " |")
    for q in ("p50", "p95"):
        cells = [f"{row[f'ttft_ms_{q}']:.1f}" if row.get(f"ttft_ms_{q}") is not None else "—" for row in rows]
        lines.append(f"| TTFT {q}, ms | " + " | ".join(cells) + " |")
    lines.append("| failed requests | " + " | ".join(str(row["errors"]) for row in rows) + " |")
    lines.append("| batches in the means | " + " | ".join(f"{row.get('batches_used', row['batches'])} of "
                                                        f"{row['batches']}" for row in rows) + " |")
    return "\n".join(lines)
