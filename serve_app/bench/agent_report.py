"""The agent workload's figures and files, and its command (``serve-app bench-agent``; the
workload and its method: ``agent.py``)."""

import asyncio
from collections import defaultdict
from dataclasses import asdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from serve_app.bench.agent import DEFAULT, PREFIX, AgentWorkload, bench_agent
from serve_app.bench.client import DEFAULT_MODEL, check_local
from serve_app.bench.report import detect_region, fmt, md_table, output_dir, run_meta, write_json
from serve_app.bench.stats import percentile
from serve_app.paths import REPO_ROOT

BENCHMARKS_DIR = REPO_ROOT / "docs" / "benchmarks"


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def summarize_arm(turns: Sequence[Mapping[str, Any]], wall_s: float) -> dict[str, Any]:
    """One arm's turns: errors, TTFT by turn, cache hits, affinity, throughput."""
    good = [t for t in turns if t["ok"]]
    by_turn: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for turn in good:
        by_turn[turn["turn"]].append(turn)
    later = [t for t in good if t["turn"] >= 2]

    def hits(of: Sequence[Mapping[str, Any]]) -> float | None:
        return _ratio(sum(t["cached_tokens"] or 0 for t in of), sum(t["prompt_tokens"] or 0 for t in of))

    # Ideal: turn N reuses all of turn N−1's prompt (the engine's block size rounds a little off).
    previous = {(t["round"], t["session"], t["turn"]): t for t in good}
    pairs = [(t, previous.get((t["round"], t["session"], t["turn"] - 1))) for t in later]
    pairs = [(t, p) for t, p in pairs if p is not None]
    ideal = sum(p["prompt_tokens"] or 0 for _, p in pairs)
    placed = [(t, p) for t, p in pairs if t["replica"] is not None and p["replica"] is not None]
    failed: dict[str, int] = defaultdict(int)
    for turn in turns:
        if not turn["ok"]:
            failed[turn["error"] or "unknown"] += 1
    later_ttft = [t["ttft_ms"] for t in later]
    completion = sum(t["completion_tokens"] for t in good)
    # What the request router said of each turn ≥ 2 (pg_metadata.routing, the span's reason):
    # sent where its session or prefix is (affinity), or elsewhere (least loaded, shed, default).
    decided = [t for t in later if t.get("routing")]
    affinity = sum(t["routing"]["reason"] in ("session", "prefix") for t in decided)
    policies = sorted({t["routing"]["policy"] for t in good if t.get("routing")})
    return {
        "turns": len(turns), "ok": len(good), "errors": len(turns) - len(good), "error_reasons": dict(failed),
        "ttft_ms_by_turn": {n: {"n": len(ts), "p50": percentile([t["ttft_ms"] for t in ts], 50),
                                "p95": percentile([t["ttft_ms"] for t in ts], 95), "cache_hit_ratio": hits(ts)}
                            for n, ts in sorted(by_turn.items())},
        "ttft_ms_p50_turns_2_plus": percentile(later_ttft, 50),
        "ttft_ms_p95_turns_2_plus": percentile(later_ttft, 95),
        "cache_hit_ratio": hits(good),
        "cache_hit_ratio_turns_2_plus": hits(later),
        "cached_of_ideal_turns_2_plus": _ratio(sum(t["cached_tokens"] or 0 for t, _ in pairs), ideal),
        "same_replica_as_previous_turn": _ratio(sum(t["replica"] == p["replica"] for t, p in placed), len(placed)),
        "routed_by_affinity_turns_2_plus": _ratio(affinity, len(decided)),
        "routing_policies": policies,
        "completion_tokens": completion,
        "wall_s": wall_s,
        "aggregate_tokens_per_s": _ratio(completion, wall_s),
    }


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """Per arm, and ours against Serve's default when both ran."""
    arms: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(b["arm"] for b in result["batches"]):
        wall = sum(b["wall_s"] for b in result["batches"] if b["arm"] == arm)
        arms[arm] = summarize_arm([t for t in result["turns"] if t["arm"] == arm], wall)
    summary: dict[str, Any] = {"arms": arms}
    if PREFIX in arms and DEFAULT in arms:
        ours, default = arms[PREFIX], arms[DEFAULT]
        summary["prefix_vs_default"] = {
            "ttft_p50_turns_2_plus": _ratio(ours["ttft_ms_p50_turns_2_plus"] or 0, default["ttft_ms_p50_turns_2_plus"] or 0),
            "aggregate_tokens_per_s": _ratio(ours["aggregate_tokens_per_s"] or 0, default["aggregate_tokens_per_s"] or 0),
        }
    return summary


def markdown(document: Mapping[str, Any]) -> str:
    summary, workload = document["summary"], document["meta"]["workload"]
    lines = [f"# Agent workload: {workload['sessions']} sessions × {workload['turns']} turns, "
             f"~{workload['system_tokens']} shared tokens", ""]
    rows = []
    for arm, s in summary["arms"].items():
        rows.append([arm, f"{s['ok']}/{s['turns']}", fmt(s["ttft_ms_p50_turns_2_plus"], " ms"),
                     fmt(s["ttft_ms_p95_turns_2_plus"], " ms"), _pct(s["cache_hit_ratio"]),
                     _pct(s["cache_hit_ratio_turns_2_plus"]), _pct(s["cached_of_ideal_turns_2_plus"]),
                     _pct(s["same_replica_as_previous_turn"]), _pct(s["routed_by_affinity_turns_2_plus"]),
                     fmt(s["aggregate_tokens_per_s"], "")])
    lines += [md_table(["arm", "ok", "TTFT p50 (turns ≥ 2)", "TTFT p95 (turns ≥ 2)", "cache hit", "cache hit (≥ 2)",
                        "of ideal (≥ 2)", "same replica (≥ 2)", "affinity (≥ 2)", "aggregate tok/s"], rows), ""]
    turns = sorted({n for s in summary["arms"].values() for n in s["ttft_ms_by_turn"]})
    by_turn = [[str(n)] + [f"{fmt(t.get('p50'), ' ms')} / {fmt(t.get('p95'), ' ms')} ({_pct(t.get('cache_hit_ratio'))})"
                           for t in (s["ttft_ms_by_turn"].get(n, {}) for s in summary["arms"].values())] for n in turns]
    lines += ["TTFT p50 / p95 by turn (cache-hit ratio):", "",
              md_table(["turn", *summary["arms"]], by_turn), ""]
    if comparison := summary.get("prefix_vs_default"):
        lines.append(f"Prefix affinity / Serve's default: TTFT p50 on turns ≥ 2 ×{fmt(comparison['ttft_p50_turns_2_plus'], '', 2)}, "
                     f"aggregate tok/s ×{fmt(comparison['aggregate_tokens_per_s'], '', 2)}.")
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f} %"


def command(
    target: Annotated[str, typer.Option(help="Our server's base URL (127.0.0.1 / localhost only).")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(envvar="SERVE_APP_DEV_API_KEY", help="Bearer key for --target.")] = None,
    model: Annotated[str, typer.Option(help="Model id to request.")] = DEFAULT_MODEL,
    sessions: Annotated[int, typer.Option(min=1, help="Agents at once (per batch).")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="Turns per session.")] = 6,
    system_tokens: Annotated[int, typer.Option(min=0, help="Shared system prompt + tool schema, in tokens (~4 chars).")] = 2000,
    user_tokens: Annotated[int, typer.Option(min=1, help="Each new user message, in tokens.")] = 100,
    max_tokens: Annotated[int, typer.Option(min=1, help="Each answer's limit.")] = 64,
    ignore_eos: Annotated[bool, typer.Option(help="Send vLLM's ignore_eos: answers run to max_tokens.")] = True,
    think_s: Annotated[float, typer.Option(min=0, help="An agent's pause between its turns (its tool run).")] = 0.2,
    stagger_s: Annotated[float, typer.Option(min=0, help="Session i starts i × this after the first.")] = 0.25,
    session_header: Annotated[bool, typer.Option(help="Name each session in x-session-id.")] = True,
    context: Annotated[str, typer.Option(help="shared: one system prompt and tool schema for a batch's sessions; "
                                              "own: each session its own (no prefix shared between sessions).")] = "shared",
    routing: Annotated[bool, typer.Option(help="Compare our request router with Serve's default, interleaved "
                                                  "(the deployment runs it with compare_with_default).")] = False,
    rounds: Annotated[int, typer.Option(min=1, help="Batches per arm.")] = 2,
    quiet_s: Annotated[float, typer.Option(help="Seconds of idle before every batch.")] = 2.0,
    region: Annotated[str | None, typer.Option(help="Output folder's region (default: the target's /health).")] = None,
    out_dir: Annotated[Path, typer.Option(help="Root of the results: <out-dir>/<region>-<date>/<model>/.")] = BENCHMARKS_DIR,
) -> None:
    """The agent workload: shared prefixes, growing conversations; TTFT by turn, cache hits."""
    try:
        url = check_local(target)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if routing and not session_header:
        raise typer.BadParameter("--routing assigns sessions to arms by their x-session-id: drop --no-session-header")
    if context not in ("shared", "own"):
        raise typer.BadParameter("--context is shared or own")
    flags = dict(locals())
    workload = AgentWorkload(model, sessions, turns, system_tokens, user_tokens, max_tokens, ignore_eos, think_s,
                             stagger_s, session_header, context)
    meta = {**run_meta(flags), "region": region or detect_region(url), "workload": asdict(workload)}
    result = asyncio.run(bench_agent(url, workload, api_key=api_key, rounds=rounds, compare=routing, quiet_s=quiet_s,
                                     on_batch=lambda r, arm: typer.echo(f"round {r + 1}: {arm}")))
    document = {"meta": meta, "summary": summarize(result), **result}
    out = output_dir(out_dir, meta["region"], model)
    write_json(out / "agent_bench.json", document)
    (out / "agent_bench.md").write_text(text := markdown(document))
    typer.echo(text)
    typer.echo(f"wrote {out}/agent_bench.json, agent_bench.md")
    if any(s["ok"] == 0 for s in document["summary"]["arms"].values()):
        typer.echo("error: an arm had no successful turn (see error_reasons)", err=True)
        raise typer.Exit(1)
    if (problem := comparison_problem(document["summary"])) is not None:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(1)


def comparison_problem(summary: Mapping[str, Any]) -> str | None:
    """Why a ``--routing`` run compared nothing, or None: each arm's turns must have been routed by
    its own policy, which only a deployment with ``compare_with_default`` does (else both arms ran
    ours, and the "comparison" is of our router with itself)."""
    arms = summary["arms"]
    if DEFAULT not in arms:
        return None
    wanted = {PREFIX: ["prefix_affinity"], DEFAULT: ["default"]}
    wrong = {arm: arms[arm]["routing_policies"] for arm in (PREFIX, DEFAULT) if arms[arm]["routing_policies"] != wanted[arm]}
    if not wrong:
        return None
    return (f"the arms were not routed by their own policies ({wrong}): deploy the model with "
            "routing.compare_with_default (configs/local-agent.yaml), or run without --routing")
