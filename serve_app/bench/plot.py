"""``llm_bench.png``: TTFT distribution, aggregate throughput and TTFT p50 by concurrency."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serve_app.bench.schedule import BASELINE, OURS
from serve_app.bench.stats import server_ttft_ms

COLORS = {OURS: "tab:blue", BASELINE: "tab:orange"}


def _cdf(ax, values: list[float], label: str, **style) -> None:
    ordered = sorted(values)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label, **style)


def _by_concurrency(ax, results: Mapping[str, Any], key: str, ylabel: str) -> None:
    levels = sorted(results, key=int)
    for side in (OURS, BASELINE):
        points = [(int(c), results[c][side]["summary"][key]) for c in levels if side in results[c]]
        points = [(c, v) for c, v in points if v is not None]
        if points:
            ax.plot(*zip(*points), marker="o", color=COLORS[side], label=side)
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.set_xticks([int(c) for c in levels])
    ax.grid(alpha=0.3)
    ax.legend()


def plot(document: Mapping[str, Any], path: Path) -> Path:
    """Panel 1 at the lowest concurrency measured (1 by default): CDF of end-to-end TTFT per side
    and of ours' server-only TTFT (the gap between those two curves is the network overhead)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file, on any machine
    import matplotlib.pyplot as plt

    results = document["results"]
    lowest = min(results, key=int)
    fig, (ttft, throughput, ttft_p50) = plt.subplots(1, 3, figsize=(16, 4.8))
    for side in (OURS, BASELINE):
        runs = [r for r in results[lowest].get(side, {}).get("runs", []) if r["ok"]]
        _cdf(ttft, [r["ttft_ms"] for r in runs], f"{side} end-to-end", color=COLORS[side])
        server = [v for r in runs if (v := server_ttft_ms(r["server"])) is not None]
        _cdf(ttft, server, f"{side} server-only", color=COLORS[side], linestyle="--")
    ttft.set_title(f"TTFT distribution, concurrency {lowest}")
    ttft.set_xlabel("TTFT (ms)")
    ttft.set_ylabel("fraction of requests")
    ttft.grid(alpha=0.3)
    ttft.legend()
    _by_concurrency(throughput, results, "aggregate_tokens_per_s", "aggregate output tok/s")
    throughput.set_title("Aggregate throughput")
    _by_concurrency(ttft_p50, results, "ttft_ms_p50", "TTFT p50 (ms)")
    ttft_p50.set_title("TTFT p50 (end to end)")
    fig.suptitle(f"{document['meta']['flags']['model']}: ours vs baseline ({document['meta']['captured']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
