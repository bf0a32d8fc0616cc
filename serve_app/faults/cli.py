"""``serve-app faults``: run the fault suite against a running service on this machine.

    make run                                   # in one terminal
    serve-app faults --key sk-local-dev        # in another: every scenario, full size
    serve-app faults --only overload,fuzz --quick

It prints each scenario's figures as it ends and writes them all to ``--out`` (JSON). The
scenarios that read or act on the cluster (disconnect's engine counts, the engine kill, memory,
the redeploy) join the local Ray cluster (``--ray-address``). Sizes: the full suite is what
docs/reliability.md reports; ``--quick`` is the CI size (seconds per scenario, the engine kill
aside, which lasts as long as a replica takes to come back).
"""

import asyncio
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer

from serve_app.bench.client import check_local
from serve_app.faults import cluster, fuzz, redeploy, scenarios
from serve_app.faults.engine_kill import engine_kill, engine_kill_resumed

SCENARIOS = ("overload", "disconnect", "engine_kill", "soak", "fuzz", "redeploy", "resume")
# Full size, and the CI size. Local capacity is 32 ongoing + 64 queued per router replica
# (configs/local.yaml): 96 for make run's one router, so the full 160 streams shed some; the test
# session's two routers hold 160, and its quick run checks only that what is shed is well-formed
# (with short answers: the burst's length is the engine's, not the router's).
SIZES = {
    "full": {"overload": 160, "overload_tokens": 64, "disconnect": 8, "kill": 8, "soak": 64, "soak_s": 60.0,
             "fuzz_examples": 20, "fuzz_s": 180, "redeploy": 32, "redeploy_model": 32,
             "redeploy_model_changes_together": False},
    # A model change's new engine starts while the streams run: on 2 cores, 32 of them starve it
    # for minutes (218 s measured), 8 let it start in about half that; and the engine flag and the
    # weights change in one deploy (one engine start fewer: CI's time).
    "quick": {"overload": 120, "overload_tokens": 16, "disconnect": 4, "kill": 4, "soak": 16, "soak_s": 8.0,
              "fuzz_examples": 3, "fuzz_s": 20, "redeploy": 32, "redeploy_model": 8,
              "redeploy_model_changes_together": True},
}


def run_suite(
    url: str, key: str, *, only: tuple[str, ...] = SCENARIOS, size: str = "full", app: str | None = "llm",
    config_path: Path | None = None, dashboard: str | None = None,
) -> dict[str, Any]:
    """Every scenario in ``only``, in the order of ``SCENARIOS``; figures by scenario. The
    routers' memory is read before and after the whole run (the suite's own leak check)."""
    n = SIZES[size]
    report: dict[str, Any] = {"url": url, "size": size, "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    routers_before = {r.pid: round(r.rss_mib, 1) for r in cluster.routers(app)} if app else None
    runs = {
        "overload": lambda: asyncio.run(scenarios.overload(url, key, app, streams=n["overload"],
                                                           max_tokens=n["overload_tokens"])),
        "disconnect": lambda: asyncio.run(scenarios.disconnect(url, key, app, streams=n["disconnect"])),
        "engine_kill": lambda: asyncio.run(engine_kill(url, key, app, streams=n["kill"])),
        "soak": lambda: asyncio.run(scenarios.soak(url, key, app, streams=n["soak"], duration_s=n["soak_s"])),
        "fuzz": lambda: {
            "schemathesis": fuzz.schemathesis_run(url, key, max_examples=n["fuzz_examples"], max_time_s=n["fuzz_s"]),
            "hostile": fuzz.hostile_bodies(url, key),
        },
        "redeploy": lambda: asyncio.run(redeploy.redeploy(
            url, key, config_path=config_path, app=app, dashboard=dashboard, streams=n["redeploy"],
            model_streams=n["redeploy_model"], model_changes_together=n["redeploy_model_changes_together"],
        )),
        "resume": lambda: asyncio.run(engine_kill_resumed(url, key, app, streams=n["kill"])),
    }
    for name in SCENARIOS:
        if name not in only:
            continue
        if app is None and name in ("engine_kill", "redeploy", "resume"):
            report[name] = {"skipped": "needs the cluster (--app)"}
            continue
        began = time.monotonic()
        report[name] = {**runs[name](), "seconds": round(time.monotonic() - began, 1)}
        typer.echo(f"== {name}\n{json.dumps(report[name], indent=2)}")
    if app:
        after = cluster.routers(app)
        report["routers"] = {
            "rss_mib_before": routers_before,
            "rss_mib_after": {r.pid: round(r.rss_mib, 1) for r in after},
            "imported_vllm": any(r.imported_vllm() for r in after),
        }
    return report


def command(
    url: Annotated[str, typer.Option(help="The service; loopback only.")] = "http://127.0.0.1:8000",
    key: Annotated[str | None, typer.Option(help="API key or token [default: $SERVE_APP_DEV_API_KEY].")] = None,
    only: Annotated[str, typer.Option(help=f"Scenarios, comma separated, of: {', '.join(SCENARIOS)}.")] = ",".join(SCENARIOS),
    quick: Annotated[bool, typer.Option(help="CI sizes instead of the full ones.")] = False,
    app: Annotated[str, typer.Option(help="The Serve application behind the URL.")] = "llm",
    ray_address: Annotated[str, typer.Option(help="The Ray cluster serving it.")] = "auto",
    config: Annotated[Path, typer.Option(help="The config it was deployed from (redeploy).")] = Path("configs/local.yaml"),
    dashboard: Annotated[str, typer.Option(help="Ray dashboard, for `serve deploy`.")] = "http://127.0.0.1:8265",
    out: Annotated[Path | None, typer.Option(help="Write the figures here (JSON).")] = None,
) -> None:
    """Overload, disconnects, an engine-core kill, a soak, fuzzing, a redeploy and a resumed
    engine kill (on another replica, or a peer region's), with figures."""
    url = check_local(url)
    key = key or os.environ.get("SERVE_APP_DEV_API_KEY")
    if not key:
        raise typer.BadParameter("give --key or set SERVE_APP_DEV_API_KEY", param_hint="--key")
    chosen = tuple(name.strip() for name in only.split(",") if name.strip())
    if unknown := sorted(set(chosen) - set(SCENARIOS)):
        raise typer.BadParameter(f"unknown scenario(s) {', '.join(unknown)}", param_hint="--only")
    cluster.connect(ray_address)
    report = run_suite(
        url, key, only=chosen, size="quick" if quick else "full", app=app, config_path=config, dashboard=dashboard
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        typer.echo(f"wrote {out}")
