"""What a benchmark leaves behind: the output folder, run metadata, JSON and Markdown tables."""

import datetime
import json
import os
import platform
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from serve_app.bench.client import ADMISSION_HEADERS, PROMPT
from serve_app.bench.schedule import BASELINE, OURS
from serve_app.bench.stats import stream_ratios
from serve_app.paths import REPO_ROOT

SECRET_FLAGS = ("--api-key", "--baseline-api-key")
SUMMARY_HEADERS = ["concurrency", "side", "runs", "errors", "TTFT p50", "TTFT p95", "server-only TTFT p50",
                   "server-only TTFT p95", "network overhead p50", "tok/s per stream p50", "aggregate tok/s",
                   "sustained tok/s"]
# Ratio = ours / baseline; overhead = ours − baseline, in ms and in % of the baseline.
RATIO_HEADERS = ["concurrency", "aggregate tok/s ratio", "sustained tok/s ratio", "tok/s per stream p50 ratio",
                 "TTFT overhead p50", "TTFT overhead p95"]
# Nearest-rank p95 of n values is the largest one while ceil(0.95 n) == n, i.e. n < 20.
TAIL_STREAMS = 20
RATIO_CAPTION = "Ours vs baseline: ratio = ours / baseline; overhead = ours − baseline (% of baseline)."


# --- where and what ----------------------------------------------------------------------------
def detect_region(url: str) -> str:
    """The ``region`` the target's ``/health`` names (our router says it), else ``local``."""
    try:
        region = httpx.get(f"{url}/health", timeout=5).json().get("region")
    except (httpx.HTTPError, ValueError, AttributeError):
        region = None
    return region if isinstance(region, str) and region else "local"


def output_dir(root: Path, region: str, model: str, now: datetime.datetime | None = None) -> Path:
    """``root/<region>-<UTC date>/<model>/``, the model card's layout for raw runs."""
    date = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d")
    return root / f"{region}-{date}" / model.replace("/", "_")


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line with key values masked: the JSON is committed, a key must never be in it."""
    out, hide_next = [], False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide_next:
            out.append("***")
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}=***")
        else:
            out.append(arg)
        hide_next = not eq and arg in SECRET_FLAGS
    return out


def git_state() -> dict[str, Any] | None:
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}


def run_meta(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Everything needed to tell two result files apart or to rerun one; never a key."""
    return {
        "command": redact_argv(sys.argv),
        "flags": {k: str(v) if isinstance(v, Path) else v for k, v in flags.items() if "api_key" not in k},
        "prompt": PROMPT,
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg(),  # another job on the box shows up here
        },
        "git": git_state(),
        "captured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_json(path: Path, payload: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# --- formatting --------------------------------------------------------------------------------
def fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def fmt_ms_signed(value: float | None) -> str:
    """An overhead in ms with its sign (ours − baseline), or "—"."""
    return "—" if value is None else f"{value:+.1f} ms"


def fmt_overhead(overhead: Mapping[str, float | None]) -> str:
    if overhead["ms"] is None:
        return "—"
    pct = "" if overhead["pct"] is None else f" ({overhead['pct']:+.0f}%)"
    return f"{fmt_ms_signed(overhead['ms'])}{pct}"


def errors_cell(summary: Mapping[str, Any]) -> str:
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["error_reasons"].items())
    return f"{summary['errors']}" + (f" ({reasons})" if reasons else "")


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def card_table(s: Mapping[str, Any]) -> str:
    """The model card's headline table for one side at one concurrency."""
    return md_table(["Measurement", "TTFT p50", "TTFT p95", "Throughput p50"], [
        ["End-to-end (with network)", fmt(s["ttft_ms_p50"], " ms"), fmt(s["ttft_ms_p95"], " ms"),
         fmt(s["decode_tokens_per_s_p50"], " tok/s")],
        ["Server-only (no network)", fmt(s["server_ttft_ms_p50"], " ms"), fmt(s["server_ttft_ms_p95"], " ms"), "—"],
        ["Network overhead (e2e − server)", fmt(s["network_overhead_ms_p50"], " ms"),
         fmt(s["network_overhead_ms_p95"], " ms"), "—"],
    ])


def summary_row(concurrency: str, side: str, s: Mapping[str, Any]) -> list[str]:
    return [concurrency, side, str(s["runs"]), errors_cell(s), fmt(s["ttft_ms_p50"], " ms"), fmt(s["ttft_ms_p95"], " ms"),
            fmt(s["server_ttft_ms_p50"], " ms"), fmt(s["server_ttft_ms_p95"], " ms"),
            fmt(s["network_overhead_ms_p50"], " ms"), fmt(s["decode_tokens_per_s_p50"]), fmt(s["aggregate_tokens_per_s"]),
            fmt(s.get("sustained_tokens_per_s"))]


def ratio_row(concurrency: str, r: Mapping[str, Any]) -> list[str]:
    return [concurrency, fmt(r["aggregate_tokens_per_s"], "×", 2), fmt(r.get("sustained_tokens_per_s"), "×", 2),
            fmt(r["decode_tokens_per_s_p50"], "×", 2), fmt_overhead(r["ttft_overhead_p50"]),
            fmt_overhead(r["ttft_overhead_p95"])]


def stream_tables(results: Mapping[str, Any]) -> str:
    """The summary over every concurrency and side, and the ratio table when there is a baseline."""
    summary = [summary_row(c, side, entry[side]["summary"])
               for c, entry in results.items() for side in (OURS, BASELINE) if side in entry]
    text = md_table(SUMMARY_HEADERS, summary)
    ratios = [ratio_row(c, entry["ratios"]) for c, entry in results.items() if "ratios" in entry]
    if ratios:
        text += f"\n\n{RATIO_CAPTION}\n\n" + md_table(RATIO_HEADERS, ratios)
    return text + "".join(f"\n\n{line}" for line in thin_tails(results))


def thin_tails(results: Mapping[str, Any]) -> list[str]:
    """A warning per concurrency whose p95 is one stream's: nearest-rank, fewer than 20 answered
    streams make it the slowest of them (a c=1 run of 3 rounds × 5 requests has 15)."""
    lines = []
    for concurrency, entry in results.items():
        counts = {side: entry[side]["summary"]["runs"] - entry[side]["summary"]["errors"]
                  for side in (OURS, BASELINE) if side in entry}
        if counts and min(counts.values()) < TAIL_STREAMS:
            lines.append(
                f"> p95 at concurrency {concurrency} is the slowest stream of "
                f"{' and '.join(f'{n} ({side})' for side, n in counts.items())}, not a percentile: "
                f"{TAIL_STREAMS} or more a side make one (`--batch-s`, `--requests-per-worker`, `--rounds`)."
            )
    return lines


def _rounds_line(flags: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    if flags.get("batch_s"):
        batch = f"{flags['batch_s']} s per batch (every worker back to back)"
    elif flags.get("round_size"):
        batch = f"{flags['round_size']} requests per batch"
    else:
        batch = f"{flags.get('requests_per_worker')} requests back to back per worker per batch"
    count = f"{flags['runs']} counted streams per side" if flags.get("runs") and not flags.get("batch_s") else \
        f"{flags.get('rounds')} rounds"
    quiet = meta.get("quiet") or {}
    alone = {side: f"{100 * floor:.1f} %" for side, floor in (quiet.get("floors_alone") or {}).items()}
    floor = f"idle floor {100 * quiet['floor_cores']:.1f} %" if quiet and not alone else \
        "idle floor, each side alone: " + ", ".join(f"{side} {value}" for side, value in alone.items())
    measured = (f", then until the host's CPU (less the client's) over {quiet['window_s']} s windows is at most "
                f"the {floor} + {100 * quiet['margin_cores']:.1f} % of a core (timeout {quiet['timeout_s']} s)"
                ) if quiet else ""
    solo = ("; each side alone: the other's processes stopped during its batches and the quiet around them"
            if meta.get("alone") else "; both sides running throughout")
    if refused := meta.get("alone_refused"):
        solo += f" (except {', '.join(refused)}: not ours to stop)"
    return (f"- interleaved rounds, order flipped every round: {batch}, {count} per concurrency; "
            f"{meta.get('sleep_s', flags['quiet_s'])} s of sleep before each batch{measured}{solo}; "
            f"{flags['warmup']} uncounted warm-up request(s) per worker")


def admission_line(results: Mapping[str, Any]) -> str:
    """What admission our side's answers went through, over every concurrency: a run with the dev
    key or a key without a budget measures neither the budget's path nor a registry key's."""
    summaries = [entry[OURS]["summary"] for entry in results.values() if OURS in entry]
    answers = sum(s.get("ok", 0) for s in summaries)
    counts = Counter()
    for s in summaries:
        counts.update(s.get("admission") or {})
    steps = ", ".join(f"{step.replace('_', ' ')} on {counts[step]}" for step in ADMISSION_HEADERS.values())
    missing = [step.replace("_", " ") for step in ADMISSION_HEADERS.values() if counts[step] < answers]
    warning = f" (**not measured on every answer: {', '.join(missing)}**; give `--api-key` a registry key with a budget)" \
        if missing else ""
    return f"- admission on {OURS}, from its answers' headers: {steps} of {answers} answers{warning}"


def stream_markdown(document: Mapping[str, Any]) -> str:
    """``llm_bench.md``: how it was measured, the card's table per side and concurrency, summary,
    ratios, then the rounds, CPU, quiet and engine sections (``serve_app.bench.cpu_report``)."""
    from serve_app.bench.cpu_report import markdown_sections  # it formats with this module's helpers

    meta, sides = document["meta"], document["sides"]
    flags = meta["flags"]
    warning = (document.get("engine_env") or {}).get("mismatches") or []
    lines = [
        f"# Streaming benchmark: {flags['model']} ({meta['captured']})", "",
        *([f"> **WARNING: the engine does not run the same way on both sides** ({'; '.join(warning)})", ""]
          if warning else []),
        *(f"- {name}: {side['url']} (model `{side['model']}`)" for name, side in sides.items()),
        f"- streaming chat completions at concurrency {flags['concurrency']}, "
        f"max_tokens {flags['max_tokens']}, ignore_eos {flags['ignore_eos']}, prompt \"{meta['prompt']}\"",
        _rounds_line(flags, meta),
        admission_line(document["results"]),
        f"- machine: {meta['machine']['nproc']} CPUs, {meta['machine']['platform']}; "
        f"commit {(meta['git'] or {}).get('commit', 'unknown')}{' (dirty)' if (meta['git'] or {}).get('dirty') else ''}",
        f"- command: `{' '.join(meta['command'])}`", "",
        "End-to-end = client clock. Server-only TTFT = pg_metadata queue_ms + inference_ttft_ms. "
        "Network overhead = p50 of per-request (end-to-end − server-only). Throughput = per-stream decode "
        "tok/s, (completion tokens − 1) / (last − first token). Aggregate = the side's completion tokens / "
        "its summed batch wall time. Sustained = tokens / seconds from the moment every worker has its first "
        "token to the moment the first worker ends its last request (ramp-up and tail left out). "
        "Percentiles are nearest-rank.", "",
        "## Summary", "", stream_tables(document["results"]), "",
    ]
    for concurrency, entry in document["results"].items():
        lines += [f"## Concurrency {concurrency}", ""]
        for side in (OURS, BASELINE):
            if side in entry:
                s = entry[side]["summary"]
                lines += [f"### {side}", "", card_table(s), "",
                          f"Aggregate {fmt(s['aggregate_tokens_per_s'], ' tok/s')} "
                          f"({s['completion_tokens']} tokens in {s['wall_s']:.1f} s); errors: {errors_cell(s)}", ""]
    return "\n".join(lines + markdown_sections(document))


def report(results: dict[str, Any], meta: dict[str, Any], out: Path) -> None:
    """Sequential targets side by side (``serve_app.bench.failover``): print, write all to JSON.

    The first target is the reference: the ratio row is second vs first.
    """
    names = list(results)
    rows = [summary_row("1", name, result["summary"]) for name, result in results.items()]
    print(md_table(SUMMARY_HEADERS, rows))
    if len(names) > 1:
        ratios = stream_ratios(results[names[1]]["summary"], results[names[0]]["summary"])
        print(md_table(["ratio", *RATIO_HEADERS[1:]], [ratio_row(f"{names[1]} / {names[0]}", ratios)]))
    meta = {**meta, "prompt": PROMPT, "captured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    print(f"wrote {write_json(out, {'meta': meta, 'targets': results})}")
