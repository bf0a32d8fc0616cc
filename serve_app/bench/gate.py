"""``serve-app bench --gate``: fail when ours' tokens/s falls below a floor of bare vLLM's.

The floors are per concurrency, ``1=0.97,16=0.95,32=0.95`` (issue #24's targets). What is
compared is the median over rounds of the per-round ratio ours / baseline of sustained tokens/s
(``serve_app.bench.stats.round_ratios``): a round is one batch of each side back to back, so a
slow minute of the host lands on both, and the median ignores one odd round.

A gate that cannot see must not pass, so it also fails, at a gated concurrency, when a round it
ran is not in the median (another process shared the host, a side had no tokens), when a request
failed on either side (a refusal takes no time: a side refusing half its requests can keep its
tokens/s), when a batch started without the host going quiet, and for the whole run when CPU was
not counted (no measured quiet, no engine check) or the two sides' engines differ (threads,
niceness, placement: ``bench.engine_env``). ``cpu_ceiling``: also fail when the median steady
CPU per token ratio is above it (issue #24: ≤ 1.3×, the host-independent figure).
"""

from collections.abc import Mapping
from typing import Any

DEFAULT_FLOORS = "1=0.97,16=0.95,32=0.95"


def parse_floors(text: str) -> dict[int, float]:
    """``"1=0.97,16=0.95"`` → ``{1: 0.97, 16: 0.95}``; ValueError naming the bad part."""
    floors: dict[int, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        level, eq, floor = part.partition("=")
        try:
            concurrency, value = int(level), float(floor)
        except ValueError:
            concurrency, value = 0, -1.0
        if not eq or concurrency < 1 or not 0 < value <= 10:
            raise ValueError(f"{part!r}: give concurrency=floor pairs, e.g. {DEFAULT_FLOORS}")
        floors[concurrency] = value
    if not floors:
        raise ValueError(f"no floors in {text!r}; e.g. {DEFAULT_FLOORS}")
    return floors


def gate_failures(results: Mapping[str, Any], floors: Mapping[int, float],
                  cpu_ceiling: float | None = None) -> list[str]:
    """One line per failing concurrency and check; empty when every floor holds."""
    failures = []
    for concurrency, floor in sorted(floors.items()):
        entry = results.get(str(concurrency))
        if entry is None:
            failures.append(f"c={concurrency}: not measured (floor {floor:.2f}×); add it to --concurrency")
            continue
        spread = entry.get("spread") or {}
        ratio = spread.get("tokens_per_s_ratio") or {}
        median = ratio.get("median")
        if median is None:
            failures.append(f"c={concurrency}: no tokens/s ratio (no baseline, or no round where both sides streamed)")
        elif median < floor:
            failures.append(f"c={concurrency}: tokens/s ratio {median:.3f}× (median of {ratio['n']} rounds, "
                            f"{ratio['min']:.3f}–{ratio['max']:.3f}×) is below the floor {floor:.2f}×")
        failures += _unseen(concurrency, entry, spread, ratio)
        steady = (spread.get("steady_cpu_ratio") or {}).get("median")
        if cpu_ceiling is not None and (steady is None or steady > cpu_ceiling):
            seen = "not measured" if steady is None else f"{steady:.3f}×"
            failures.append(f"c={concurrency}: CPU per token ratio under steady load {seen} is above the ceiling "
                            f"{cpu_ceiling:.2f}×")
    return failures


def _unseen(concurrency: int, entry: Mapping[str, Any], spread: Mapping[str, Any],
            ratio: Mapping[str, Any]) -> list[str]:
    """What the figures at one concurrency do not stand on."""
    failures = []
    run, used = spread.get("rounds_run"), ratio.get("n", 0)
    if run is not None and used < run:
        why = sorted({r["excluded"] for r in spread.get("rounds", []) if r.get("excluded")}) or ["a side did not run"]
        failures.append(f"c={concurrency}: {used} of {run} rounds in the median ({'; '.join(why)}); run it again")
    failed = {side: entry[side]["summary"].get("errors", 0) for side in ("ours", "baseline") if side in entry}
    if any(failed.values()):
        counts = ", ".join(f"{side} {n}" for side, n in failed.items() if n)
        failures.append(f"c={concurrency}: failed requests ({counts}): the rates do not compare like with like")
    waits = [r["quiet"] for side in ("ours", "baseline") for r in entry.get(side, {}).get("rounds", [])
             if r.get("quiet")]
    if timed_out := sum(bool(w.get("timed_out")) for w in waits):
        failures.append(f"c={concurrency}: {timed_out} batch(es) started before the host was quiet "
                        "(--quiet-timeout-s): something else was running")
    return failures


def run_failures(document: Mapping[str, Any]) -> list[str]:
    """The whole run's: CPU not counted, or the two sides' engines not alike."""
    failures = []
    cpu = document.get("meta", {}).get("cpu")
    if cpu is not None:  # absent: counted
        failures.append(f"CPU {cpu}: no measured quiet, no engine check; the gate needs both")
    for problem in (document.get("engine_env") or {}).get("mismatches", []):
        failures.append(f"engines differ: {problem}")
    return failures
