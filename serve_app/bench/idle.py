"""``serve-app idle``: what the running local service costs while nobody uses it.

Every process of the Ray cluster serving the target's port (``serve_app.bench.procs``: GCS,
raylet, dashboard and its agents, the Serve controller, proxy and HAProxy manager, HAProxy, the
rate-limit actor, the router and model replicas and their vLLM engine cores, the driver),
sampled twice ``seconds`` apart with no request sent; per process and per group, % of one core
= 100 × CPU-seconds / seconds. Issue #24's target for the whole service is 5 % of one core.
"""

import time
from collections.abc import Callable, Mapping
from typing import Any

from serve_app.bench.cpu import Meter
from serve_app.bench.procs import GROUPS, OURS, ProcessTable, discover

DEFAULT_TARGET_PCT = 5.0


def measure_idle(
    table: ProcessTable,
    port: int,
    seconds: float,
    *,
    target_pct: float = DEFAULT_TARGET_PCT,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
    client_pid: int | None = None,
) -> dict[str, Any]:
    """``{"seconds", "processes": [{"group", "process", "pid", "pct_core"}], "groups", "total_pct",
    "target_pct", "within_target", "exited", "missed"}``; DiscoveryError if no cluster serves ``port``."""
    sleep, clock = sleep or time.sleep, clock or time.monotonic
    meter = Meter(table, lambda: [t for t in discover(table, ours_port=port, client_pid=client_pid)
                                  if t.side == OURS], clock=clock)
    before = meter.snapshot()
    sleep(seconds)
    cpu = meter.cpu_between(before, meter.snapshot())
    elapsed = cpu["window_s"]
    pct = (lambda used: 100 * used / elapsed) if elapsed > 0 else (lambda used: 0.0)
    side = cpu["sides"].get(OURS, {"total": 0.0, "groups": {}, "processes": {}})
    tracked = {f"{t.label} [{t.pid}]": t for t in meter.tracked.values()}
    rows = [{"group": tracked[key].group, "process": tracked[key].label, "pid": tracked[key].pid,
             "pct_core": pct(used)} for key, used in side["processes"].items()]
    order = {g: i for i, g in enumerate(GROUPS)}
    groups = {g: pct(v) for g, v in sorted(side["groups"].items(), key=lambda kv: order.get(kv[0], len(order)))}
    total = pct(side["total"])
    return {"seconds": elapsed, "processes": sorted(rows, key=lambda r: -r["pct_core"]), "groups": groups,
            "total_pct": total, "target_pct": target_pct, "within_target": total <= target_pct,
            "exited": cpu["exited"], "missed": cpu["missed"]}


def idle_text(result: Mapping[str, Any]) -> str:
    """The table the command prints: every process, busiest first, then the groups and the total."""
    from serve_app.bench.report import md_table

    rows = [[r["group"], r["process"], str(r["pid"]), f"{r['pct_core']:.2f} %"] for r in result["processes"]]
    groups = [[g, f"{v:.2f} %"] for g, v in sorted(result["groups"].items(), key=lambda kv: -kv[1])]
    verdict = "within" if result["within_target"] else "OVER"
    return "\n\n".join([
        f"Idle CPU of the local service over {result['seconds']:.1f} s, % of one core:",
        md_table(["group", "process", "pid", "CPU"], rows),
        md_table(["group", "CPU"], groups),
        f"total {result['total_pct']:.2f} % of one core: {verdict} the target of {result['target_pct']:.1f} %",
        *([f"exited while sampled (last seconds not counted): {', '.join(result['exited'])}"] if result["exited"] else []),
    ])
