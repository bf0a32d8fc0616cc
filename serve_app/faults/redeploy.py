"""Redeploy while streams run: the three kinds of change an SRE makes, none of which may drop a
stream (docs/operations.md, "What a change restarts"; serve_app/regions/layout.py):

- ``router setting``: the local region's failover connect timeout nudged by 1 ms, a change with
  no effect on behaviour. Serve calls the running router replicas' ``reconfigure()``; the model
  replicas are left alone (the same pids before and after).
- ``engine flag``: vLLM's ``--max-logprobs`` 20 -> 21 for the model. Serve starts a replacement
  replica beside the running one (``max_surge_percent``), routes to it once it has passed its
  health check, and drains the old one (``graceful_shutdown_timeout_s``).
- ``weights``: the model's checkpoint replaced by another, at another path (the tiny model
  regenerated with another seed stands for a new revision); replaced like an engine flag.

With ``model_changes_together`` (CI's quick size) the two model changes are one deploy, ``engine
flag and weights``: the same replacement, one new engine fewer to start (about 100 s on 2 cores).

Each change is one ``serve deploy`` of the whole config while ``streams`` clients each stream
chats back to back, from ``warmup_s`` before the deploy until the change has settled (every
application of the region RUNNING with only RUNNING replicas, deployed after the change was sent,
and for a restart none of the model's replicas from before). Per change: the streams by outcome,
how many failed and how many got a 503, the TTFT p95 of the streams sent before it and during it,
and the model's and routers' replica pids before and after. The changes build on each other; the
original config is deployed again at the end (another model restart) and waited for.
"""

import asyncio
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from serve_app.bench.stats import percentile
from serve_app.config import TINY_MODEL_SOURCE
from serve_app.devtools.serve_cli import serve_deploy, settled as applications_settled
from serve_app.faults import cluster
from serve_app.faults.scenarios import MODEL_DEPLOYMENT, MODEL_ID, _client, model_app
from serve_app.faults.traffic import Outcome, chat_body, count, stream_chat
from serve_app.regions import layout

Change = Callable[[dict[str, Any]], None]  # edits a region's settings (AppArgs, as written)
NEW_WEIGHTS_SEED = 1
SETTLE_POLL_S = 1.0
MIN_SETTLE_S = 3.0  # the controller has picked the change up by then, whatever it was


def _model(settings: dict[str, Any]) -> dict[str, Any]:
    (entry,) = [m for m in settings["models"] if m["id"] == MODEL_ID]
    return entry


def nudge_router_setting(settings: dict[str, Any]) -> None:
    failover = settings.setdefault("failover", {})
    failover["connect_timeout_s"] = round(float(failover.get("connect_timeout_s", 2.0)) + 0.001, 3)


def change_engine_flag(settings: dict[str, Any]) -> None:
    _model(settings).setdefault("engine", {}).setdefault("extra_args", {})["max-logprobs"] = 21


def new_weights(path: Path) -> Change:
    def change(settings: dict[str, Any]) -> None:
        _model(settings).setdefault("engine", {})["source"] = str(path)

    return change


def all_of(*changes: Change) -> Change:
    """One change that makes each of ``changes`` in turn."""
    def change(settings: dict[str, Any]) -> None:
        for each in changes:
            each(settings)

    return change


def with_region(config: dict[str, Any], app: str, change: Change) -> dict[str, Any]:
    """``config`` with the region whose router application is ``app`` changed by ``change`` and
    laid out again, its applications where they were; the other regions' untouched."""
    settings = layout.region_args(config, app)
    owned = {app} | {layout.model_app_name(app, m["id"]) for m in settings["models"]}
    change(settings)
    changed = copy.deepcopy(config)
    (router,) = [a for a in changed["applications"] if a["name"] == app]
    laid_out = layout.region_applications(settings, name=app, route_prefix=router.get("route_prefix", "/"))
    applications = []
    for application in changed["applications"]:
        if application["name"] == app:
            applications += laid_out
        elif application["name"] not in owned:
            applications.append(application)
    changed["applications"] = applications
    return changed


def _pids(app: str) -> dict[str, list[int]]:
    return {
        "model": sorted(r.pid for r in cluster.model_replicas(model_app(app), MODEL_DEPLOYMENT)),
        "routers": sorted(r.pid for r in cluster.routers(app)),
    }


def _settled(apps: list[str], deployed_at: float) -> bool:
    """``serve_cli.settled`` for ``apps``, read through this driver's connection to Ray."""
    from dataclasses import asdict

    from ray import serve

    return applications_settled(asdict(serve.status()), deployed_at, apps)


async def wait_settled(app: str, deployed_at: float, *, replaced: list[int] | None, timeout_s: float) -> float | None:
    """Seconds from now until the region of ``app`` has settled (``replaced``: model pids that
    must all be gone), or None at ``timeout_s``."""
    started = time.monotonic()
    await asyncio.sleep(MIN_SETTLE_S)
    while time.monotonic() - started < timeout_s:
        if await asyncio.to_thread(_settled, [app, model_app(app)], deployed_at):
            if not replaced or not set(replaced) & set((await asyncio.to_thread(_pids, app))["model"]):
                return round(time.monotonic() - started, 1)
        await asyncio.sleep(SETTLE_POLL_S)
    return None


class Load:
    """``streams`` clients, each streaming a chat, then the next, until stopped."""

    def __init__(self, client, url: str, streams: int, max_tokens: int):
        self.client, self.url, self.streams, self.max_tokens = client, url, streams, max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> "Load":
        self._tasks = [asyncio.create_task(self._one_client()) for _ in range(self.streams)]
        return self

    async def _one_client(self) -> None:
        while not self._stop.is_set():
            self.outcomes.append(await stream_chat(self.client, self.url, chat_body(self.max_tokens), idle_timeout_s=120))

    async def stop(self) -> list[Outcome]:
        """Let every stream under way finish (they are part of the figures), then stop."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


def _ttft_p95(outcomes: list[Outcome]) -> float | None:
    p95 = percentile((o.first_chunk_s for o in outcomes), 95)
    return None if p95 is None else round(p95, 3)


async def one_change(client, url: str, app: str, config: dict[str, Any], dashboard: str, *, name: str,
                     restarts_model: bool, streams: int, max_tokens: int, warmup_s: float,
                     settle_timeout_s: float) -> dict[str, Any]:
    before = await asyncio.to_thread(_pids, app)
    load = Load(client, url, streams, max_tokens).start()
    await asyncio.sleep(warmup_s)  # every client's first stream is under way
    deployed_at, sent = time.time(), time.monotonic()
    deploy = await asyncio.to_thread(serve_deploy, config, dashboard)
    settled_s = await wait_settled(app, deployed_at - 0.5, replaced=before["model"] if restarts_model else None,
                                   timeout_s=settle_timeout_s) if deploy.returncode == 0 else None
    settled = time.monotonic()
    outcomes = await load.stop()
    after = await asyncio.to_thread(_pids, app)
    during = [o for o in outcomes if sent <= o.started_at <= settled]
    return {
        "change": name,
        "restarts_model": restarts_model,
        "deploy_exit": deploy.returncode,
        "deploy_error": deploy.stderr.strip().splitlines()[-3:] if deploy.returncode else None,
        "settled_after_s": settled_s,
        "streams": len(outcomes),
        "streams_started_during": len(during),
        "streams_by_outcome": count(outcomes),
        "streams_failed": sum(o.label != "200 done" for o in outcomes),
        "503s": sum(o.status == 503 for o in outcomes),
        # A stream cut by a stopped replica and resumed elsewhere still ends "200 done": counted
        # apart, or a draining gap would pass for a clean drain.
        "streams_resumed": sum(o.resumes > 0 or o.resumed_in is not None for o in outcomes),
        "ttft_p95_s_before": _ttft_p95([o for o in outcomes if o.started_at < sent]),
        "ttft_p95_s_during": _ttft_p95(during),
        "model_pids_before": before["model"], "model_pids_after": after["model"],
        "router_pids_before": before["routers"], "router_pids_after": after["routers"],
    }


async def redeploy(
    url: str, key: str, *, config_path: Path, app: str, dashboard: str, streams: int = 32, max_tokens: int = 64,
    warmup_s: float = 5.0, settle_timeout_s: float = 900, model_streams: int | None = None,
    model_changes_together: bool = False,
) -> dict[str, Any]:
    """The three changes in turn on the deployed ``config_path`` (the region of router
    application ``app`` is changed), then the original again; the figures of each. ``streams``
    clients stream through each change, or ``model_streams`` through a model's (a new engine
    starts meanwhile: on a small host, fewer clients let it start sooner);
    ``model_changes_together`` makes the two model changes one deploy."""
    original = yaml.safe_load(config_path.read_text())
    model_changes: list[tuple[str, Change]] = [("engine flag", change_engine_flag)]
    if _model(layout.region_args(original, app)).get("engine", {}).get("source") == TINY_MODEL_SOURCE:
        from serve_app.devtools.tiny_model import ensure_tiny_model

        weights = await asyncio.to_thread(ensure_tiny_model, seed=NEW_WEIGHTS_SEED)
        model_changes.append(("weights", new_weights(weights)))
    if model_changes_together:
        model_changes = [(" and ".join(name for name, _ in model_changes), all_of(*(c for _, c in model_changes)))]
    changes = [("router setting", nudge_router_setting, False)] + [(name, c, True) for name, c in model_changes]
    model_streams = streams if model_streams is None else model_streams
    report: dict[str, Any] = {"streams": streams, "model_streams": model_streams, "max_tokens": max_tokens, "changes": []}
    config = original
    async with _client(key, streams + 2) as client:
        for name, change, restarts_model in changes:
            config = with_region(config, app, change)
            report["changes"].append(await one_change(
                client, url, app, config, dashboard, name=name, restarts_model=restarts_model,
                streams=model_streams if restarts_model else streams,
                max_tokens=max_tokens, warmup_s=warmup_s, settle_timeout_s=settle_timeout_s,
            ))
        # Put the original back (the model restarts once more), so the suite leaves the app as it found it.
        replaced = (await asyncio.to_thread(_pids, app))["model"]
        deployed_at = time.time()
        restore = await asyncio.to_thread(serve_deploy, original, dashboard)
        report["restored"] = {
            "deploy_exit": restore.returncode,
            "settled_after_s": await wait_settled(app, deployed_at - 0.5, replaced=replaced, timeout_s=settle_timeout_s),
        }
    return report
