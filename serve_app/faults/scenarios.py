"""Load and loss: overload, client disconnects, a soak. Each returns its figures as a dict.

They need only the URL and a key, except where they read the cluster (engine unfinished
requests, replica memory): those figures are ``None`` when ``app`` is None (no Ray access).
"""

import asyncio
import time
from typing import Any

import httpx

from serve_app.bench.client import DEFAULT_MODEL
from serve_app.bench.stats import percentile
from serve_app.config import ModelDeploymentArgs
from serve_app.faults import cluster
from serve_app.faults.traffic import HealthProbe, Outcome, chat_body, count, post_chat, stream_chat
from serve_app.regions.layout import model_app_name

MODEL_ID = DEFAULT_MODEL
MODEL_DEPLOYMENT = ModelDeploymentArgs.deployment_name_of(MODEL_ID)


def model_app(app: str) -> str:
    """The application the model behind router application ``app`` runs in (regions/layout.py)."""
    return model_app_name(app, MODEL_ID)


def _client(key: str, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        headers={"Authorization": f"Bearer {key}"},
        limits=httpx.Limits(max_connections=connections + 8, max_keepalive_connections=connections + 8),
    )




async def overload(
    url: str, key: str, app: str | None = None, *, streams: int = 120, max_tokens: int = 64, hold_tokens: int = 2000, idle_timeout_s: float = 120
) -> dict[str, Any]:
    """Two phases, ``/health`` probed every 0.25 s throughout.

    *Burst*: ``streams`` at once. Whatever is admitted must end with ``[DONE]``; what is not must
    be shed at once (503 ``overloaded`` with ``Retry-After``); nothing may hang. How many are shed
    depends on how fast the engine drains the queue meanwhile.
    *Held full*: ``streams`` long streams take every slot and queue place; those that find no
    place are shed, each as it arrives at a full queue (the steady-state cost of shedding). Then
    five single requests (5 s timeout): with one router replica each is shed at once; with
    several, one may land on a router whose queue still has room and wait. The long streams are
    then abandoned (the clients leave; the engine aborts them)."""
    async with _client(key, streams + 8) as client:
        probe = HealthProbe(client, url, period_s=0.25).start()
        burst = await asyncio.gather(
            *(stream_chat(client, url, chat_body(max_tokens), idle_timeout_s=idle_timeout_s) for _ in range(streams))
        )
        held_outcomes: list[Outcome] = []

        async def hold() -> None:
            held_outcomes.append(await stream_chat(client, url, chat_body(hold_tokens), idle_timeout_s=idle_timeout_s))

        held = [asyncio.create_task(hold()) for _ in range(streams)]
        await asyncio.sleep(3)  # admitted, queued or shed by now
        extra = [await post_chat(client, url, chat_body(4, stream=False), timeout_s=5) for _ in range(5)]
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        abandoned = await _unfinished_after_leaving(app)
        await probe.stop()
    shed = [o for o in burst if o.status == 503]
    held_shed = [o for o in held_outcomes if o.status == 503]
    return {
        "streams": streams,
        "by_outcome": count(list(burst)),
        "hung": sum(o.ended == "hung" for o in burst),
        "shed": len(shed),
        "shed_with_retry_after": sum(o.retry_after is not None for o in shed),
        "time_to_503_s": _spread([o.status_s for o in shed]),
        "held_full": {
            "by_outcome": count(held_outcomes),
            "shed": len(held_shed),
            "shed_with_retry_after": sum(o.retry_after is not None for o in held_shed),
            "time_to_503_s": _spread([o.status_s for o in held_shed]),
        },
        "abandoned_unfinished_after": abandoned,
        "single_requests_while_full": [
            {"status": o.status, "code": o.error_code or o.ended, "s": round(o.total_s or 0, 4)} for o in extra
        ],
        "health": probe.summary(),
    }


def _spread(values: list[float | None]) -> dict[str, float | None]:
    """Nearest-rank p50 and the maximum, as the benchmark computes them (bench/stats.py)."""
    p50, top = percentile(values, 50), percentile(values, 100)
    return {"p50": None if p50 is None else round(p50, 4), "max": None if top is None else round(top, 4)}


async def disconnect(
    url: str, key: str, app: str | None, *, streams: int = 8, after_chunks: int = 3, max_tokens: int = 2000
) -> dict[str, Any]:
    """Clients that leave mid-stream: the engine must abort their requests (KV cache freed), so
    its unfinished count falls back to what it was within seconds."""
    before = await _unfinished(app)
    async with _client(key, streams) as client:
        outcomes = await asyncio.gather(
            *(stream_chat(client, url, chat_body(max_tokens), leave_after_chunks=after_chunks) for _ in range(streams))
        )
    after = await _unfinished_after_leaving(app)
    return {"streams": streams, "by_outcome": count(list(outcomes)), "unfinished_before": before, "unfinished_after": after}


async def soak(
    url: str, key: str, app: str | None, *, streams: int = 64, duration_s: float = 60, max_tokens: int = 32
) -> dict[str, Any]:
    """``streams`` clients back to back for ``duration_s``: no errors, and the router's and the
    replica's memory before and after (a leak shows as growth that a longer soak extends). A
    client that is shed waits its ``Retry-After``, as the openai SDK does; sheds are counted apart
    from errors."""
    memory_before = _memory(app)
    deadline = time.monotonic() + duration_s
    outcomes: list[Outcome] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            outcome = await stream_chat(client, url, chat_body(max_tokens))
            outcomes.append(outcome)
            if outcome.status == 503 and outcome.retry_after:
                await asyncio.sleep(min(float(outcome.retry_after), max(0.0, deadline - time.monotonic())))

    async with _client(key, streams) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
    return {
        "streams": streams,
        "duration_s": duration_s,
        "requests": len(outcomes),
        "by_outcome": count(outcomes),
        "shed": sum(o.label == "503 json overloaded" for o in outcomes),
        "errors": sum(o.label not in ("200 done", "503 json overloaded") for o in outcomes),
        "memory_mib_before": memory_before,
        "memory_mib_after": _memory(app),
    }


async def _unfinished_after_leaving(app: str | None) -> dict[str, int | None]:
    """The engine's unfinished requests 2 s and 10 s after clients left."""
    left_at = time.monotonic()
    after: dict[str, int | None] = {}
    for mark in (2, 10):
        await asyncio.sleep(max(0.0, left_at + mark - time.monotonic()))
        after[f"+{mark}s"] = await _unfinished(app)
    return after


async def _unfinished(app: str | None) -> int | None:
    # A blocking handle call, off the loop the traffic runs on.
    return await asyncio.to_thread(cluster.unfinished_requests, model_app(app), MODEL_DEPLOYMENT) if app else None


def _memory(app: str | None) -> dict[str, float] | None:
    if app is None:
        return None
    return {f"{r.deployment}:{r.pid}": round(r.rss_mib, 1) for r in cluster.replicas(app)}
