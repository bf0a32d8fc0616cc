"""``serve-app bench --gate``: fail when ours' tokens/s falls below a floor of bare vLLM's.

The floors are per concurrency, ``1=0.97,16=0.95,32=0.95`` (issue #24's targets). What is
compared is the median over rounds of the per-round ratio ours / baseline of sustained tokens/s
(``serve_app.bench.stats.round_ratios``): a round is one batch of each side back to back, so a
slow minute of the host lands on both, and the median ignores one odd round. A floor for a
concurrency that was not measured, or one without a ratio (no baseline, no successful round),
fails too: a gate that cannot see must not pass.
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


def gate_failures(results: Mapping[str, Any], floors: Mapping[int, float]) -> list[str]:
    """One line per failing concurrency; empty when every floor holds."""
    failures = []
    for concurrency, floor in sorted(floors.items()):
        entry = results.get(str(concurrency))
        if entry is None:
            failures.append(f"c={concurrency}: not measured (floor {floor:.2f}×); add it to --concurrency")
            continue
        ratio = (entry.get("spread") or {}).get("tokens_per_s_ratio") or {}
        median = ratio.get("median")
        if median is None:
            failures.append(f"c={concurrency}: no tokens/s ratio (no baseline, or no round where both sides streamed)")
        elif median < floor:
            failures.append(f"c={concurrency}: tokens/s ratio {median:.3f}× (median of {ratio['n']} rounds, "
                            f"{ratio['min']:.3f}–{ratio['max']:.3f}×) is below the floor {floor:.2f}×")
    return failures
