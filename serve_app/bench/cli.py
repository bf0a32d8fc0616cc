"""``serve-app bench``, ``bench-capacity``, ``bench-setting`` and ``idle`` (wired into ``serve_app.cli``)."""

import asyncio
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml

from serve_app.bench.alone import Alone
from serve_app.bench.capacity import CAPACITY_HEADERS, bench_capacity, capacity_table
from serve_app.bench.client import DEFAULT_MODEL, Side, check_local
from serve_app.bench.cpu import Meter
from serve_app.bench.cpu_report import SPREAD_HEADERS, spread_rows
from serve_app.bench.engine_env import engine_envs, mismatches, warning_block
from serve_app.bench.gate import DEFAULT_FLOORS, gate_failures, parse_floors, run_failures
from serve_app.bench.idle import DEFAULT_TARGET_PCT, idle_text, measure_idle
from serve_app.bench.plot import plot
from serve_app.bench.host import PsutilTable
from serve_app.bench.procs import DiscoveryError, ProcessTable, discover
from serve_app.bench.report import detect_region, md_table, output_dir, run_meta, stream_markdown, stream_tables, write_json
from serve_app.bench.schedule import BASELINE, OURS
from serve_app.bench.setting import bench_setting, config_with, summary_table
from serve_app.bench.streams import REQUESTS_PER_WORKER, ROUNDS, bench_streams
from serve_app.bench.vllm import RAY_WORKER_NICENESS, bare_vllm
from serve_app.devtools.serve_cli import deploy_or_raise, until_applied
from serve_app.paths import REPO_ROOT

# Options both commands take.
Target = Annotated[str, typer.Option(help="Our server's base URL (127.0.0.1 / localhost only).")]
ApiKey = Annotated[str | None, typer.Option(envvar="SERVE_APP_DEV_API_KEY", help="Bearer key or token for --target.")]
Model = Annotated[str, typer.Option(help="Model id to request.")]
Baseline = Annotated[str | None, typer.Option(help="Base URL of an already running OpenAI server (e.g. bare vLLM).")]
BaselineVllm = Annotated[Path | None, typer.Option(
    help="Start bare vLLM (nice 15) with the engine flags this Serve config gives --model's replica.")]
BaselineModel = Annotated[str | None, typer.Option(help="Model id for --baseline (default: --model).")]
BaselineKey = Annotated[str | None, typer.Option(help="Bearer key for --baseline, if it wants one.")]
RoundSize = Annotated[int | None, typer.Option(help="Requests per side per batch (default: bench, --requests-per-worker "
                                                    "× concurrency; bench-capacity, max(4 × concurrency, 20)).")]
Warmup = Annotated[int, typer.Option(help="Uncounted warm-up requests per worker, per side and level.")]
QuietS = Annotated[float, typer.Option(help="Seconds of idle before every batch.")]
Region = Annotated[str | None, typer.Option(help="Output folder's region (default: the target's /health region, else local).")]
OutDir = Annotated[Path, typer.Option(help="Root of the results: <out-dir>/<region>-<date>/<model>/.")]
# Results are evidence kept with the docs that quote them (the repository's top level is fixed).
BENCHMARKS_DIR = REPO_ROOT / "docs" / "benchmarks"
# Without a meter (``--no-cpu``, or no process found) the only pause before a batch is a sleep.
FIXED_QUIET_S = 2.0
# An idle floor above this is no idle service: a spinning engine, a start-up still going on.
BUSY_FLOOR_CORES = 0.5


def process_table() -> ProcessTable:
    """The host's process table (the unit tests replace it with a fake one)."""
    return PsutilTable()


def _concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise typer.BadParameter(f"{text!r}: give positive integers separated by commas, e.g. 1,16,32")
    return levels


def _local(url: str) -> str:
    try:
        return check_local(url)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _sides(stack: ExitStack, flags: dict[str, Any]) -> list[Side]:
    """Ours, then the baseline if one is asked for (starting bare vLLM inside ``stack``)."""
    baseline, baseline_vllm = flags["baseline"], flags["baseline_vllm"]
    sides = [Side(OURS, _local(flags["target"]), flags["model"], flags["api_key"])]
    if baseline and baseline_vllm:
        raise typer.BadParameter("give --baseline or --baseline-vllm, not both")
    if baseline:
        model = flags["baseline_model"] or flags["model"]
        sides.append(Side(BASELINE, _local(baseline), model, flags["baseline_api_key"]))
    elif baseline_vllm:
        try:
            started = bare_vllm(baseline_vllm, niceness=RAY_WORKER_NICENESS, model_id=flags["model"])
            url, served = stack.enter_context(started)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--baseline-vllm") from None
        sides.append(Side(BASELINE, url, served))
    return sides


@contextmanager
def _progress_bar() -> Iterator[Callable[[str, int], Callable[[str], None]]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:

        def start(label: str, total: int) -> Callable[[str], None]:
            task = bar.add_task(label, total=total)
            return lambda side: bar.update(task, advance=1, description=f"{label} {side}")

        yield start


def _measure(flags: dict[str, Any], bench: Callable[[list[Side], Any], Coroutine[Any, Any, dict]]):
    """Sides, meta and results: start the baseline if asked, run ``bench`` under a progress bar,
    stop the baseline. ``flags`` are the command's parameters (keys are left out of the meta)."""
    with ExitStack() as stack:
        sides = _sides(stack, flags)
        meta = {**run_meta(flags), "region": flags["region"] or detect_region(sides[0].url)}
        with _progress_bar() as progress:
            results = asyncio.run(bench(sides, progress))
    return sides, meta, results


def _port(url: str) -> int:
    parsed = httpx.URL(url)
    return parsed.port or (443 if parsed.scheme == "https" else 80)


def _meter(sides: list[Side], flags: dict[str, Any]) -> tuple[Meter | None, dict[str, Any]]:
    """The CPU meter over every process of both sides, or None (said on stderr and in the meta)."""
    if not flags["cpu"]:
        return None, {"cpu": "off (--no-cpu)"}
    table = process_table()
    ports = {side.name: _port(side.url) for side in sides}

    def find():
        return discover(table, ours_port=ports.get(OURS), baseline_port=ports.get(BASELINE))

    try:
        meter = Meter(table, find, window_s=flags["quiet_window_s"], margin_cores=flags["quiet_cpu_pct"] / 100,
                      timeout_s=flags["quiet_timeout_s"])
    except DiscoveryError as err:
        typer.echo(f"warning: CPU not counted, batches start after a fixed {FIXED_QUIET_S} s: {err}", err=True)
        return None, {"cpu": f"not counted: {err}"}
    return meter, {}


def _engine_check(meter: Meter | None) -> dict[str, Any] | None:
    """Both sides' engine processes as they run now; warns loudly when they differ."""
    if meter is None:
        return None
    meter.refresh()
    envs = engine_envs(meter.table, meter.tracked.values())
    problems = mismatches(envs)
    if problems:
        typer.echo(warning_block(problems), err=True)
    return {"processes": envs, "mismatches": problems}


def _sides_meta(sides: list[Side]) -> dict[str, Any]:
    return {side.name: {"url": side.url, "model": side.model} for side in sides}


def stream(
    target: Target = "http://127.0.0.1:8000",
    api_key: ApiKey = None,
    model: Model = DEFAULT_MODEL,
    runs: Annotated[int | None, typer.Option(min=1, help="Counted streams per side per concurrency "
                                             "(default: --rounds rounds of full batches).")] = None,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma separated.")] = "1,16,32",
    max_tokens: Annotated[int, typer.Option(min=1)] = 64,
    ignore_eos: Annotated[bool, typer.Option(help="Send vLLM's ignore_eos: always generate max_tokens.")] = False,
    baseline: Baseline = None,
    baseline_vllm: BaselineVllm = None,
    baseline_model: BaselineModel = None,
    baseline_api_key: BaselineKey = None,
    round_size: RoundSize = None,
    warmup: Warmup = 1,
    quiet_s: Annotated[float | None, typer.Option(help="Seconds of sleep before every batch, before the measured "
                                                  f"quiet (default 0; {FIXED_QUIET_S} without CPU counting).")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per concurrency (one batch per side each).")] = ROUNDS,
    requests_per_worker: Annotated[int, typer.Option(min=1, help="Requests each worker sends back to back per batch."
                                                     )] = REQUESTS_PER_WORKER,
    batch_s: Annotated[float | None, typer.Option(min=0.1, help="Instead: every batch lasts this many seconds.")] = None,
    cpu: Annotated[bool, typer.Option(help="Count every process's CPU and wait for measured quiet.")] = True,
    quiet_cpu_pct: Annotated[float, typer.Option(min=0, help="Quiet = the host's CPU (less the client's) at most "
                                                 "the idle floor measured at the start + this (% of one core).")] = 5.0,
    quiet_window_s: Annotated[float, typer.Option(min=0.05, help="Window the quiet CPU is measured over.")] = 0.5,
    quiet_timeout_s: Annotated[float, typer.Option(min=0, help="Start the batch anyway after this wait.")] = 15.0,
    quiet_floor_pct: Annotated[float | None, typer.Option(min=0, help="The idle floor (% of one core) instead of "
                                                          "measuring it at the start; 0: an absolute threshold.")] = None,
    gate: Annotated[bool, typer.Option(help="Exit 1 when a tok/s ratio (median over rounds) is below its floor.")
                    ] = False,
    gate_floors: Annotated[str, typer.Option(help="Floors per concurrency for --gate.")] = DEFAULT_FLOORS,
    gate_cpu_ceiling: Annotated[float | None, typer.Option(min=0, help="--gate also fails above this CPU per token "
                                                           "ratio (steady load), e.g. 1.3.")] = None,
    alone: Annotated[bool, typer.Option(help="Stop (SIGSTOP) the other side's server during each batch and the "
                                        "quiet around it, so neither side's batches carry the other's idle CPU.")
                     ] = True,
    region: Region = None,
    out_dir: OutDir = BENCHMARKS_DIR,
) -> None:
    """Streaming TTFT, tokens/s and CPU per token, ours vs a baseline, interleaved (the model card's method)."""
    levels = _concurrency_list(concurrency)
    floors = _floors(gate_floors) if gate else None
    if round_size is not None and round_size < max(levels) and not batch_s:
        raise typer.BadParameter(f"{round_size} requests a batch cannot keep {max(levels)} streams in flight",
                                 param_hint="--round-size")
    if gate and not (baseline or baseline_vllm):
        raise typer.BadParameter("--gate compares against a baseline: give --baseline-vllm CONFIG or --baseline URL")
    flags = dict(locals())
    document: dict[str, Any] = {}

    async def run(sides: list[Side], progress) -> dict:
        meter, why = _meter(sides, flags)
        document.update(why)
        solo = Alone(meter, say=lambda line: typer.echo(line, err=True)) if meter and alone else None
        document["alone"] = solo is not None and len(sides) > 1
        pause = quiet_s if quiet_s is not None else (0.0 if meter else FIXED_QUIET_S)
        document["sleep_s"] = pause
        if meter:
            floor = await meter.measure_floor() if quiet_floor_pct is None else quiet_floor_pct / 100
            meter.floor_cores = floor
            if solo is not None and len(sides) > 1 and quiet_floor_pct is None:
                for side in sides:  # each side's own idle, the other stopped, as its batches run
                    with solo.running(side.name):
                        await meter.measure_floor(side=side.name)
            if floor > BUSY_FLOOR_CORES:
                typer.echo(f"warning: the idle floor is {100 * floor:.0f} % of a core: something on the host is "
                           "busy, so the quiet wait hardly waits (see --quiet-floor-pct)", err=True)
            document["quiet"] = {"floor_cores": floor, "margin_cores": meter.margin_cores, "window_s": meter.window_s,
                                 "threshold_cores": meter.threshold_cores, "timeout_s": meter.timeout_s,
                                 "floors_alone": dict(meter.floors)}
            _engine_check(meter)
        results = await bench_streams(
            sides, levels, runs=runs, max_tokens=max_tokens, ignore_eos=ignore_eos, round_size=round_size,
            warmup=warmup, quiet_s=pause, rounds=rounds, requests_per_worker=requests_per_worker, batch_s=batch_s,
            meter=meter, alone=solo, progress=progress,
        )
        document["engine_env"] = _engine_check(meter)
        if solo is not None and solo.refused:
            document["alone_refused"] = [f"{label} [{pid}]" for pid, label in solo.refused.items()]
        return results

    sides, meta, results = _measure(flags, run)
    meta.update({k: document.pop(k) for k in ("cpu", "quiet", "sleep_s", "alone", "alone_refused") if k in document})
    document = {"meta": meta, "sides": _sides_meta(sides), "results": results, **document}
    failures = [*gate_failures(results, floors, gate_cpu_ceiling), *run_failures(document)] if floors else []
    if floors:
        document["gate"] = {"floors": {str(k): v for k, v in floors.items()}, "failures": failures}
    out = output_dir(out_dir, meta["region"], model)
    write_json(out / "llm_bench.json", document)
    (out / "llm_bench.md").write_text(stream_markdown(document))
    plot(document, out / "llm_bench.png")
    typer.echo(stream_tables(results))
    if rows := spread_rows(results):
        typer.echo("\n" + md_table(SPREAD_HEADERS, rows))
    typer.echo(f"wrote {out}/llm_bench.json, llm_bench.md, llm_bench.png")
    if any(entry[s.name]["summary"]["ok"] == 0 for entry in results.values() for s in sides):
        typer.echo("error: a side had no successful stream at some concurrency (see error_reasons)", err=True)
        raise typer.Exit(1)
    for failure in failures:
        typer.echo(f"gate: {failure}", err=True)
    if failures:
        raise typer.Exit(1)
    if floors:
        typer.echo(f"gate: passed ({gate_floors})")


def _floors(text: str) -> dict[int, float]:
    try:
        return parse_floors(text)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--gate-floors") from None


def capacity(
    target: Target = "http://127.0.0.1:8000",
    api_key: ApiKey = None,
    model: Model = DEFAULT_MODEL,
    concurrency: Annotated[int, typer.Option(min=1, help="Workers per batch.")] = 16,
    models_requests: Annotated[int, typer.Option(min=0, help="Counted GET /v1/models per side.")] = 500,
    chat_requests: Annotated[int, typer.Option(min=0, help="Counted max_tokens=1 chats per side.")] = 100,
    duration_s: Annotated[float, typer.Option(help="Cap on each side's counted time per workload.")] = 60.0,
    baseline: Baseline = None,
    baseline_vllm: BaselineVllm = None,
    baseline_model: BaselineModel = None,
    baseline_api_key: BaselineKey = None,
    round_size: RoundSize = None,
    warmup: Warmup = 1,
    quiet_s: QuietS = 2.0,
    region: Region = None,
    out_dir: OutDir = BENCHMARKS_DIR,
) -> None:
    """Router capacity: requests/s for GET /v1/models and max_tokens=1 chats, ours vs a baseline."""
    sides, meta, results = _measure(dict(locals()), lambda sides, progress: bench_capacity(
        sides, concurrency=concurrency, requests={"models": models_requests, "chat": chat_requests},
        round_size=round_size, warmup=warmup, quiet_s=quiet_s, duration_s=duration_s, progress=progress,
    ))
    out = write_json(output_dir(out_dir, meta["region"], model) / "router_capacity.json",
                     {"meta": meta, "sides": _sides_meta(sides), "results": results})
    typer.echo(md_table(CAPACITY_HEADERS, capacity_table(results)))
    typer.echo(f"wrote {out}")


def idle(
    target: Target = "http://127.0.0.1:8000",
    seconds: Annotated[float, typer.Option(min=0.1, help="How long to sample (no request is sent).")] = 30.0,
    target_pct: Annotated[float, typer.Option(help="The whole service's budget, % of one core.")] = DEFAULT_TARGET_PCT,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of the table.")] = False,
) -> None:
    """The running local service's idle CPU, per process (% of one core); exit 1 over the target."""
    url = _local(target)
    try:
        result = measure_idle(process_table(), _port(url), seconds, target_pct=target_pct)
    except DiscoveryError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(result, indent=2) if as_json else idle_text(result))
    if not result["within_target"]:
        raise typer.Exit(1)


def wire_tls(
    streams: Annotated[int, typer.Option(min=1, help="Streams at once per round (a replica's slots).")] = 32,
    events: Annotated[int, typer.Option(min=1, help="SSE events per stream (tokens).")] = 200,
    event_bytes: Annotated[int, typer.Option(min=16, help="Bytes per event (a chat token chunk: ~150).")] = 150,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds per side, interleaved.")] = 8,
    out_dir: OutDir = BENCHMARKS_DIR,
) -> None:
    """What TLS on the router-replica byte socket costs: connect time and CPU, plaintext vs TLS."""
    from serve_app.bench.wire_tls import run as run_wire_tls

    result = run_wire_tls(streams, events, event_bytes, rounds)
    meta = run_meta(dict(streams=streams, events=events, event_bytes=event_bytes, rounds=rounds))
    out = write_json(output_dir(out_dir, "local", "wire") / "stream_tls.json", {"meta": meta, "result": result})
    rows = [[side, *(str(figures[name]) for name in ("connect_ms_p50", "connect_ms_p95", "cpu_us_per_stream",
                                                      "cpu_us_per_event", "mb_per_s"))]
            for side, figures in result["sides"].items()]
    typer.echo(md_table(["side", "connect ms p50", "connect ms p95", "CPU µs per stream", "CPU µs per event", "MB/s"], rows))
    typer.echo(f"TLS: CPU ×{result['tls_cpu_ratio']}, +{result['tls_extra_cpu_us_per_stream']} µs CPU and "
               f"+{result['tls_extra_connect_ms_p50']} ms connect per stream (both ends)")
    typer.echo(f"wrote {out}")


def setting(
    config: Annotated[Path, typer.Option(help="The serve config the service runs (its Router's user_config is changed).")],
    name: Annotated[str, typer.Option("--setting", help="Dotted path in the Router's user_config, e.g. router.hand_off_streams.")],
    values: Annotated[str, typer.Option(help="Comma-separated values, each read as YAML (true, 30, off).")],
    target: Target = "http://127.0.0.1:8000",
    api_key: ApiKey = None,
    model: Model = DEFAULT_MODEL,
    concurrency: Annotated[int, typer.Option(min=1)] = 16,
    requests_per_worker: Annotated[int, typer.Option(min=1, help="Streams back to back per worker per batch.")] = 10,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each runs every value once, the order turning.")] = 3,
    max_tokens: Annotated[int, typer.Option(min=1)] = 64,
    ignore_eos: Annotated[bool, typer.Option(help="Send vLLM's ignore_eos: always generate max_tokens.")] = True,
    region: Region = None,
    out_dir: OutDir = BENCHMARKS_DIR,
) -> None:
    """One router setting's values in turn on the running service, interleaved: CPU-s per 1,000
    tokens per process group, and tok/s. The config is deployed as given again at the end."""
    url = _local(target)
    base = yaml.safe_load(config.read_text())
    parsed = [yaml.safe_load(v) for v in values.split(",") if v.strip()]
    if len(parsed) < 2:
        raise typer.BadParameter("give at least two values", param_hint="--values")
    try:
        config_with(base, name, parsed[0])
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--config") from None
    meter = None
    try:
        table = process_table()
        meter = Meter(table, lambda: discover(table, ours_port=_port(url)))
    except DiscoveryError as err:
        typer.echo(f"warning: CPU not counted: {err}", err=True)

    async def deploy(document: dict) -> None:
        deployed_at = time.time()
        await asyncio.to_thread(deploy_or_raise, document)
        await until_applied(url, deployed_at)

    async def apply(value) -> None:
        await deploy(config_with(base, name, value))

    async def run() -> dict:
        if meter is not None:
            await meter.measure_floor()
        try:
            return await bench_setting(
                url=url, api_key=api_key, model=model, path=name, values=parsed, concurrency=concurrency,
                requests_per_worker=requests_per_worker, rounds=rounds, max_tokens=max_tokens,
                ignore_eos=ignore_eos, apply=apply, meter=meter, progress=typer.echo)
        finally:
            await deploy(base)

    result = asyncio.run(run())
    flags = {"config": str(config), "setting": name, "values": values, "concurrency": concurrency, "rounds": rounds,
             "requests_per_worker": requests_per_worker, "max_tokens": max_tokens, "ignore_eos": ignore_eos}
    payload = {**run_meta(flags), **result}
    where = output_dir(out_dir, region or detect_region(url), model) / f"setting-{name}-c{concurrency}.json"
    write_json(where, payload)
    typer.echo(summary_table(result))
    typer.echo(f"wrote {where}")
