"""``serve-app idle``: what the running local service costs while nobody uses it.

Every process of the Ray cluster serving the target's port (``serve_app.bench.procs``: GCS,
raylet, dashboard and its agents, the Serve controller, proxy and HAProxy manager, HAProxy, the
rate-limit actor, the router and model replicas and their vLLM engine cores, the driver),
sampled twice ``seconds`` apart with no request sent; per process and per group, % of one core
= 100 × CPU-seconds / seconds. Issue #24's target for the whole service is 5 % of one core.

Each process's CPU is also split by thread (``ProcessTable.thread_cpu``: ``/proc/<pid>/task``,
threads of one name summed, the first thread called ``main``), so the table says what an idle
process spends its CPU on: in every Ray worker the ``main`` thread is Ray's core worker waking it
every 10 ms to check for signals (about 0.7 % of a core per process on the 2-core host, fixed in
Ray's C++), ``client.poll*`` and ``grpc_global_tim``/``event_engine`` are gRPC's pollers and
timers, an asyncio actor's event loop runs in a thread named after what the process was before
its title was set (``ray::IDLE``), ``gloo_tcp_loop`` is gloo's device loop in vLLM's worker, one
since ``serve_app.engine.gloo`` (docs/benchmarks.md, "The idle floor").

Wake-ups a second, per process, group and thread name (``ProcessTable.thread_wakeups``: context
switches over the window): what an idle process does, counted without the host's speed in it. The
same service read 7 % of a core one hour and 13–21 % the next on one machine (2026-12-06); a
thread that wakes every 10 ms shows 100 a second in both.
"""

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from serve_app.bench.cpu import Meter
from serve_app.bench.procs import GROUPS, MAIN_THREAD, OURS, ProcessTable, Tracked, discover

DEFAULT_TARGET_PCT = 5.0
THREAD_ROWS = 12  # of the by-name table; a process's column shows its three busiest


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
    """``{"seconds", "processes": [{"group", "process", "pid", "pct_core", "threads"}], "groups",
    "threads", "total_pct", "target_pct", "within_target", "exited", "missed"}``; a process's
    ``threads`` and the top-level ``threads`` (every process's, by name) are % of one core, busiest
    first. DiscoveryError if no cluster serves ``port``."""
    sleep, clock = sleep or time.sleep, clock or time.monotonic
    meter = Meter(table, lambda: [t for t in discover(table, ours_port=port, client_pid=client_pid)
                                  if t.side == OURS], clock=clock)
    before = meter.snapshot()
    threads_before, wakeups_before = _threads(table, meter.tracked.values())
    sleep(seconds)
    after = meter.snapshot()
    threads_after, wakeups_after = _threads(table, meter.tracked.values())
    cpu = meter.cpu_between(before, after)
    elapsed = cpu["window_s"]
    pct = (lambda used: 100 * used / elapsed) if elapsed > 0 else (lambda used: 0.0)
    side = cpu["sides"].get(OURS, {"total": 0.0, "groups": {}, "processes": {}})
    tracked = {f"{t.label} [{t.pid}]": t for t in meter.tracked.values()}
    per_s = (lambda count: count / elapsed) if elapsed > 0 else (lambda count: 0.0)
    rows, by_name, wakeups_by_name, group_wakeups = [], Counter(), Counter(), Counter()
    for key, used in side["processes"].items():
        t = tracked[key]
        # a process seen at the start is charged what its threads used since; one born in the
        # window, all of it (as its process total is, Meter.cpu_between)
        seen = t.pid in before.cpu
        threads = _since(threads_before.get(t.pid, {}) if seen else {}, threads_after.get(t.pid, {}), pct)
        wakeups = _since(wakeups_before.get(t.pid, {}) if seen else {}, wakeups_after.get(t.pid, {}), per_s)
        woke = sum(wakeups.values())
        by_name.update(threads)
        wakeups_by_name.update(wakeups)
        group_wakeups[t.group] += woke
        rows.append({"group": t.group, "process": t.label, "pid": t.pid, "pct_core": pct(used),
                     "threads": _busiest(threads), "wakeups_per_s": woke})
    order = {g: i for i, g in enumerate(GROUPS)}
    groups = {g: pct(v) for g, v in sorted(side["groups"].items(), key=lambda kv: order.get(kv[0], len(order)))}
    total = pct(side["total"])
    return {"seconds": elapsed, "processes": sorted(rows, key=lambda r: -r["pct_core"]), "groups": groups,
            "threads": _busiest(by_name), "total_pct": total, "target_pct": target_pct,
            "within_target": total <= target_pct, "exited": cpu["exited"], "missed": cpu["missed"],
            "group_wakeups_per_s": {g: group_wakeups.get(g, 0.0) for g in groups},
            "thread_wakeups_per_s": _busiest(wakeups_by_name), "wakeups_per_s": sum(group_wakeups.values())}


def _threads(table: ProcessTable, tracked: Iterable[Tracked]) -> tuple[dict[int, dict], dict[int, dict]]:
    """Per pid: each thread's CPU-seconds, and its context switches (by thread id: (name, value))."""
    cpu, wakeups = {}, {}
    for t in tracked:
        if (used := table.thread_cpu(t.pid, t.create_time)) is not None:
            cpu[t.pid] = used
        if (switched := table.thread_wakeups(t.pid, t.create_time)) is not None:
            wakeups[t.pid] = switched
    return cpu, wakeups


def _since(start: Mapping[int, tuple[str, float]], end: Mapping[int, tuple[str, float]],
           rate: Callable[[float], float]) -> dict[str, float]:
    """What the threads added over the window, thread by thread, summed by name (at its end) as
    ``rate`` of it; names that added nothing left out. A thread born in the window counts from zero;
    one that ended in it is not in ``end`` and adds nothing: by name, its whole life would otherwise
    come off its namesakes' (a process's CPU is its own total, so only wake-ups miss its last part)."""
    added: dict[str, float] = {}
    for tid, (name, value) in end.items():
        added[name] = added.get(name, 0) + value - (start[tid][1] if tid in start else 0)
    return {name: rate(value) for name, value in added.items() if value > 0}


def _busiest(threads: Mapping[str, float]) -> dict[str, float]:
    return dict(sorted(threads.items(), key=lambda kv: -kv[1]))


def idle_text(result: Mapping[str, Any]) -> str:
    """The table the command prints: every process, busiest first, with its busiest threads; then
    the groups, the threads by name across processes, and the total."""
    from serve_app.bench.report import md_table

    # a result without wake-ups (written before they were counted) shows dashes, not zeros
    counted = "wakeups_per_s" in result
    wakeups, by_name = result.get("group_wakeups_per_s", {}), result.get("thread_wakeups_per_s", {})
    rows = [[r["group"], r["process"], str(r["pid"]), f"{r['pct_core']:.2f} %", _per_s(r.get("wakeups_per_s")),
             _thread_list(r.get("threads", {}))] for r in result["processes"]]
    groups = [[g, f"{v:.2f} %", _per_s(wakeups.get(g, 0.0) if counted else None)]
              for g, v in sorted(result["groups"].items(), key=lambda kv: -kv[1])]
    cpu_by_name = result.get("threads", {})
    # the busiest names by CPU, then any of the most wakeful that CPU alone would leave out
    names = list(cpu_by_name)[:THREAD_ROWS]
    names += [name for name in list(by_name)[:THREAD_ROWS // 2] if name not in names]
    threads = [[name, f"{cpu_by_name.get(name, 0.0):.2f} %", _per_s(by_name.get(name, 0.0) if counted else None)]
               for name in names]
    verdict = "within" if result["within_target"] else "OVER"
    return "\n\n".join([
        f"Idle CPU of the local service over {result['seconds']:.1f} s, % of one core, and wake-ups a second:",
        md_table(["group", "process", "pid", "CPU", "wake-ups/s", "busiest threads"], rows),
        md_table(["group", "CPU", "wake-ups/s"], groups),
        f"By thread name, every process ({MAIN_THREAD}: a process's first thread):",
        md_table(["thread", "CPU", "wake-ups/s"], threads),
        f"total {result['total_pct']:.2f} % of one core, {_per_s(result.get('wakeups_per_s'))} wake-ups a second: "
        f"{verdict} the target of {result['target_pct']:.1f} %",
        *([f"exited while sampled (last seconds' CPU and every wake-up not counted): {', '.join(result['exited'])}"]
          if result["exited"] else []),
    ])


def _thread_list(threads: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in list(threads.items())[:3]) or "—"


def _per_s(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"
