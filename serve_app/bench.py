"""Streaming latency benchmark, after the model card's published method.

N sequential streaming chat completions (default 100) against one or more OpenAI-shaped targets;
per target: TTFT p50/p95 as the client sees it (end to end), tokens/s p50, total latency, and,
where the server sends a ``pg_metadata`` SSE event, the server-only TTFT and the network
overhead (end to end − server). Targets run one after another in the same invocation, so a
Serve deployment and a bare ``vllm serve`` on the same model compare side by side; ratios are
against the first target. Prints a table and writes every run to JSON.

    python -m serve_app.bench --target serve=http://127.0.0.1:8000 --runs 100 --out bench.json
    python -m serve_app.bench --target serve=http://127.0.0.1:8000 --baseline-vllm configs/local.yaml

``--baseline-vllm CONFIG`` starts bare vLLM's OpenAI server (``python -m
vllm.entrypoints.openai.api_server``) on 127.0.0.1 with exactly the engine flags the config's
first model gets inside Serve, benchmarks it as target ``vllm``, and stops it by PID.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml

PROMPT = "Say hi in one short sentence."


@dataclass
class Run:
    ok: bool
    ttft_ms: float | None = None
    total_ms: float | None = None
    completion_tokens: int = 0
    tokens_per_s: float | None = None
    server: dict[str, Any] = field(default_factory=dict)  # the pg_metadata event, if any
    error: str | None = None


def stream_once(client: httpx.Client, url: str, model: str, max_tokens: int) -> Run:
    """One streaming chat completion, timed on the client's wall clock (end to end)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first_token = None
    tokens = 0
    server: dict[str, Any] = {}
    event_name = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return Run(ok=False, error=f"HTTP {response.status_code}: {response.read()[:200]!r}")
        for line in response.iter_lines():
            if line.startswith("event:"):
                event_name = line.split(":", 1)[1].strip()
                continue
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            payload = json.loads(data)
            if event_name == "pg_metadata" or "pg_metadata" in payload:
                server = payload.get("pg_metadata", payload)
            elif payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            elif first_token is None and any(
                (c.get("delta") or {}).get("content") for c in payload.get("choices", [])
            ):
                first_token = time.perf_counter()
            event_name = None
    total = time.perf_counter() - started
    if first_token is None:
        return Run(ok=False, error="no content token in the stream")
    return Run(
        ok=True,
        ttft_ms=(first_token - started) * 1000,
        total_ms=total * 1000,
        completion_tokens=tokens,
        tokens_per_s=tokens / total if total else None,
        server=server,
    )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(runs: list[Run]) -> dict[str, Any]:
    good = [r for r in runs if r.ok]
    ttft = [r.ttft_ms for r in good]
    server_ttft = [r.server["inference_ttft_ms"] for r in good if "inference_ttft_ms" in r.server]
    summary = {
        "runs": len(runs),
        "errors": len(runs) - len(good),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p95": percentile(ttft, 95),
        "total_ms_p50": percentile([r.total_ms for r in good], 50),
        "tokens_per_s_p50": percentile([r.tokens_per_s for r in good if r.tokens_per_s], 50),
        "server_ttft_ms_p50": percentile(server_ttft, 50),
        "server_ttft_ms_p95": percentile(server_ttft, 95),
    }
    if summary["server_ttft_ms_p50"] is not None:
        summary["network_overhead_ms_p50"] = summary["ttft_ms_p50"] - summary["server_ttft_ms_p50"]
    return summary


def bench_target(
    url: str, model: str, runs: int, max_tokens: int, warmup: int, api_key: str | None = None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=120, headers=headers) as client:
        for _ in range(warmup):
            stream_once(client, url, model, max_tokens)
        results = [stream_once(client, url, model, max_tokens) for _ in range(runs)]
    return {"url": url, "summary": summarize(results), "runs": [asdict(r) for r in results]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, failed: Callable[[], str | None] = lambda: None) -> float:
    """Seconds until ``url/health`` answers 200; RuntimeError on timeout or when ``failed`` says why."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if (why := failed()) is not None:
            raise RuntimeError(why)
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url}/health not 200 after {timeout_s:.0f} s")


@contextmanager
def bare_vllm(config_path: Path):
    """Bare vLLM's OpenAI server with the same engine flags the config gives the Serve replica."""
    from serve_app import catalog
    from serve_app.config import parse_app_args
    from serve_app.engine.deployment import resolve_model_path

    config = yaml.safe_load(config_path.read_text())
    model = parse_app_args(config["applications"][0]["args"]).models[0]
    port = free_port()
    flags = model.engine_cli_args(resolve_model_path(model, catalog.get(model.id).hf_repo))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags,
               "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, **model.resources.env}
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-vllm-{port}.log", "w")
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        def exited() -> str | None:
            return None if process.poll() is None else f"bare vLLM exited with {process.returncode}; see {log.name}"

        wait_healthy(url, 600, failed=exited)
        print(f"bare vLLM ready after {time.monotonic() - started:.1f} s")
        yield url, model.id
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def main(
    target: Annotated[list[str], typer.Option(help="NAME=URL; repeat to compare side by side.")] = [],
    model: str = "qwen-3.6-35b-a3b",
    runs: int = 100,
    max_tokens: int = 32,
    warmup: int = 3,
    baseline_vllm: Annotated[Path | None, typer.Option(help="Serve config whose first model bare vLLM runs.")] = None,
    out: Path = Path("bench-results/bench.json"),
    api_key: Annotated[str | None, typer.Option(envvar="SERVE_APP_DEV_API_KEY", help="Bearer key for --target.")] = None,
) -> None:
    results: dict[str, Any] = {}
    for spec in target:
        name, _, url = spec.partition("=")
        if not url.startswith(("http://127.", "http://localhost")):
            raise typer.BadParameter(f"{spec}: benchmarks here target 127.0.0.1 only")
        results[name] = bench_target(url, model, runs, max_tokens, warmup, api_key)
    if baseline_vllm:
        with bare_vllm(baseline_vllm) as (url, served_model):
            results["vllm"] = bench_target(url, served_model, runs, max_tokens, warmup)
    if not results:
        raise typer.BadParameter("give at least one --target or --baseline-vllm")

    report(results, {"model": model, "runs": runs, "max_tokens": max_tokens}, out)


def report(results: dict[str, Any], meta: dict[str, Any], out: Path) -> None:
    """Print the side-by-side table (ratios against the first target) and write every run to JSON."""
    first = next(iter(results.values()))["summary"]
    keys = ["ttft_ms_p50", "ttft_ms_p95", "total_ms_p50", "tokens_per_s_p50", "server_ttft_ms_p50", "network_overhead_ms_p50"]
    print(f"{'target':<10}" + "".join(f"{k:>24}" for k in keys) + f"{'errors':>8}")
    for name, result in results.items():
        summary = result["summary"]
        cells = []
        for key in keys:
            value = summary.get(key)
            ratio = f" ({value / first[key]:.2f}x)" if value and first.get(key) and name != next(iter(results)) else ""
            cells.append(f"{'-' if value is None else f'{value:.1f}'}{ratio}".rjust(24))
        print(f"{name:<10}" + "".join(cells) + f"{summary['errors']:>8}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "prompt": PROMPT, "captured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.write_text(json.dumps({"meta": meta, "targets": results}, indent=2))
    print(f"wrote {out}")

if __name__ == "__main__":
    typer.run(main)
