"""The report's sections for rounds, CPU per token, quiet waits and the engine's environment."""

from collections.abc import Mapping
from typing import Any

from serve_app.bench.engine_env import COMPARED
from serve_app.bench.procs import BASELINE, GROUPS, OURS
from serve_app.bench.report import fmt, fmt_ms_signed, md_table
from serve_app.bench.stats import spread

GPU_NOTE = (
    "A GPU host will show smaller gaps than this one. There the engine's step time (the forward "
    "pass on the GPU) dominates every token's latency, so the gateway's fixed cost per request and "
    "per token is a smaller share of it; and the gateway's CPU is taken from cores the GPU engine "
    "does not need (the engine core drives the GPU from about one core of many), where on a small "
    "CPU-only host every CPU-second the gateway spends comes out of the cores the busy-polling "
    "engine computes on. The ratio of CPU-seconds per 1,000 tokens, ours / bare vLLM, depends far "
    "less on the host: it is the figure to compare across hosts."
)


def _x(value: float | None) -> str:
    return fmt(value, "×", 3)


def _range(s: Mapping[str, Any]) -> str:
    return "—" if s["min"] is None else f"{s['min']:.3f}–{s['max']:.3f}×"


def _ms_range(s: Mapping[str, Any]) -> str:
    return "—" if s["min"] is None else f"{s['min']:+.1f} to {s['max']:+.1f} ms"


def spread_rows(results: Mapping[str, Any]) -> list[list[str]]:
    """Per concurrency: rounds, the median and range of both ratios and of the paired TTFT overhead."""
    rows = []
    for concurrency, entry in results.items():
        if "spread" in entry:
            tok, cpu = entry["spread"]["tokens_per_s_ratio"], entry["spread"]["cpu_ratio"]
            steady = entry["spread"].get("steady_cpu_ratio") or spread([])
            ttft = entry["spread"].get("ttft_overhead_ms") or spread([])
            run = entry["spread"].get("rounds_run", tok["n"])
            rows.append([concurrency, f"{tok['n']} of {run}", _x(tok["median"]), _range(tok),
                         _x(steady["median"]), _range(steady), _x(cpu["median"]), _range(cpu),
                         fmt_ms_signed(ttft["median"]), _ms_range(ttft)])
    return rows


SPREAD_HEADERS = ["concurrency", "rounds", "sustained tok/s ratio, median", "range",
                  "CPU per token ratio under steady load, median", "range", "CPU per token ratio, whole batch, median",
                  "range", "TTFT p50 overhead, paired by round, median", "range"]


def rounds_table(entry: Mapping[str, Any]) -> str:
    rows = [[str(r["round"]), fmt(r["ours_tokens_per_s"]), fmt(r["baseline_tokens_per_s"]), _x(r["tokens_per_s_ratio"]),
             fmt(r.get("ours_steady_cpu_per_1k"), "", 2), fmt(r.get("baseline_steady_cpu_per_1k"), "", 2),
             _x(r.get("steady_cpu_ratio")),
             fmt(r["ours_cpu_per_1k"], "", 2), fmt(r["baseline_cpu_per_1k"], "", 2), _x(r["cpu_ratio"]), r["basis"],
             fmt(r.get("ours_ttft_p50_ms"), " ms"), fmt(r.get("baseline_ttft_p50_ms"), " ms"),
             fmt_ms_signed(r.get("ttft_overhead_ms")), fmt(r.get("outside_cores"), "", 2), str(r.get("errors", "—")),
             r.get("excluded") or ""]
            for r in entry["spread"]["rounds"]]
    return md_table(["round", "ours tok/s", "baseline tok/s", "ratio", "steady: ours CPU-s/1k tok", "bare", "ratio",
                     "whole batch: ours CPU-s/1k tok", "bare", "ratio", "rate over", "TTFT p50 ours", "bare",
                     "ours − bare", "other processes (cores)", "failed requests", "left out"], rows)


def cpu_table(cpu: Mapping[str, Any]) -> str:
    """CPU-seconds per 1,000 completion tokens, per group and side, with the totals and ratio."""
    ours, base = cpu.get(OURS, {}), cpu.get(BASELINE, {})
    steady_o, steady_b = ours.get("steady", {}), base.get("steady", {})
    present = set(ours.get("groups", {})) | set(base.get("groups", {}))

    def row(label, o, b, so, sb, unit="", places=3):
        return [label, fmt(so, unit, places), fmt(sb, unit, places), fmt(o, unit, places), fmt(b, unit, places)]

    rows = [row(g, ours.get("groups", {}).get(g), base.get("groups", {}).get(g),
                steady_o.get("groups", {}).get(g), steady_b.get("groups", {}).get(g))
            for g in (*GROUPS, *sorted(present - set(GROUPS))) if g in present]
    rows += [
        ["**whole side**", f"**{fmt(steady_o.get('total'), '', 3)}**", f"**{fmt(steady_b.get('total'), '', 3)}**",
         f"**{fmt(ours.get('total'), '', 3)}**", f"**{fmt(base.get('total'), '', 3)}**"],
        ["ratio ours / baseline", _x(cpu.get("ratio_steady")), "", _x(cpu.get("ratio_total")), ""],
        ["bench client (not in the totals)", "", "", fmt(ours.get("client"), "", 3), fmt(base.get("client"), "", 3)],
        ["the other server during this side's batches (CPU-s)", "", "", fmt(ours.get("other_server_cpu_s"), " s", 2),
         fmt(base.get("other_server_cpu_s"), " s", 2)],
        ["processes of neither side meanwhile (CPU-s)", "", "", fmt(ours.get("outside_cpu_s"), " s", 2),
         fmt(base.get("outside_cpu_s"), " s", 2)],
        row("seconds measured", ours.get("window_s"), base.get("window_s"), steady_o.get("window_s"),
            steady_b.get("window_s"), " s", 1),
        row("tokens counted", ours.get("tokens"), base.get("tokens"), steady_o.get("tokens"), steady_b.get("tokens"),
            "", 0),
    ]
    table = md_table(["process", "steady load: ours", "bare vLLM", "whole batch: ours", "bare vLLM"], rows)
    gone = [f"{side}: {what} {', '.join(entry[key])} (their last seconds not counted)" if key == "exited" else
            f"{side}: {what} {', '.join(entry[key])} (not counted: older than a batch, unseen at its start)"
            for side, entry in ((OURS, ours), (BASELINE, base)) for key, what in (("exited", "exited"),
                                                                                   ("missed", "missed"))
            if entry.get(key)]
    return "\n".join([table, *(f"\n- {line}" for line in gone)])


def quiet_rows(results: Mapping[str, Any]) -> list[list[str]]:
    """Per concurrency and side: the measured waits before batches, and the timeouts."""
    rows = []
    for concurrency, entry in results.items():
        for side in (OURS, BASELINE):
            waits = [r["quiet"] for r in entry.get(side, {}).get("rounds", []) if r.get("quiet")]
            if waits:
                s = spread(w["waited_s"] for w in waits)
                settles = spread(r["cpu"]["settle"]["waited_s"] for r in entry[side]["rounds"] if r.get("cpu"))
                rows.append([concurrency, side, str(len(waits)), fmt(s["median"], " s", 2), fmt(s["max"], " s", 2),
                             fmt(settles["median"], " s", 2), str(sum(w["timed_out"] for w in waits))])
    return rows


QUIET_HEADERS = ["concurrency", "side", "batches", "quiet wait p50", "max", "settle after p50", "timed out"]


def engine_env_table(envs: Mapping[str, list[Mapping[str, Any]]]) -> str:
    rows = []
    for side in (OURS, BASELINE):
        for e in envs.get(side, []):
            env = e.get("env")
            env_text = "unreadable" if env is None else ", ".join(f"{k}={v}" for k, v in env.items() if v is not None) or "—"
            rows.append([side, e["label"], str(e["pid"]), *(str(e.get(k, "—")) for k in COMPARED[:4]), env_text])
    return md_table(["side", "process", "pid", *COMPARED[:4], "thread env"], rows)


def markdown_sections(document: Mapping[str, Any]) -> list[str]:
    """Spread, rounds, CPU, quiet, engine environment and the GPU note, as Markdown lines."""
    results, lines = document["results"], []
    if rows := spread_rows(results):
        lines += ["## Ratios over rounds", "",
                  "Per round (one batch of each side back to back): ours / baseline, and ours − baseline TTFT p50 "
                  "(paired: the host's drift between rounds cancels out of it; many short rounds make it a close "
                  "estimate, e.g. `--concurrency 1 --rounds 40 --requests-per-worker 3`). Median and range over "
                  "rounds; the gate (`--gate`) reads the tok/s median.", "", md_table(SPREAD_HEADERS, rows), ""]
    for concurrency, entry in results.items():
        if "spread" in entry:
            lines += [f"### Rounds at concurrency {concurrency}", "", rounds_table(entry), ""]
    if any("cpu" in entry for entry in results.values()):
        lines += ["## CPU-seconds per 1,000 completion tokens", "",
                  "Every process of each side (utime + stime). *Steady load*: between the first and the last snapshot "
                  "(one every quiet window) inside each batch's sustained window — every worker streaming — divided "
                  "by the tokens that arrived between the same two instants: what a server under constant load "
                  "spends per token, its idle cost at the rate it runs under load. *Whole batch*: from a snapshot "
                  "before each counted batch to one after it once the servers are quiet again, divided by the "
                  "batch's completion tokens: ramp-up, tail and the wait for quiet included, so a side's idle cost "
                  "is charged for as long as its quiet takes to come.", ""]
        for concurrency, entry in results.items():
            if "cpu" in entry:
                lines += [f"### Concurrency {concurrency}", "", cpu_table(entry["cpu"]), ""]
    if rows := quiet_rows(results):
        lines += ["## Quiet before each batch (measured)", "", md_table(QUIET_HEADERS, rows), ""]
    if envs := document.get("engine_env"):
        lines += ["## The engine's environment, both sides", "", engine_env_table(envs["processes"]), ""]
        lines += [f"- **{p}**" for p in envs["mismatches"]] or ["Identical on both sides."]
        lines.append("")
    return lines + ["## On a GPU host", "", GPU_NOTE, ""]
