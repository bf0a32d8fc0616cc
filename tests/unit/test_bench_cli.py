"""``serve-app bench`` and ``bench-capacity`` end to end against a fake OpenAI server on 127.0.0.1.

One uvicorn server in a thread plays both sides: ``/ours/...`` streams with a ``pg_metadata``
event and a region in ``/health`` (as our router does), ``/base/...`` like bare vLLM (no
metadata). It records every request and whether the other side had one in flight.
"""

import asyncio
import json
import re
import os
import socket
import threading
import time

import pytest
import typer
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from typer.testing import CliRunner

from serve_app.bench import cli as bench_cli
from serve_app.bench.report import thin_tails
from serve_app.bench.procs import Proc
from serve_app.surfaces import CHAT
from serve_app.surfaces.dialects import pg_metadata_event
from tests.unit.fake_processes import Clock, FakeTable, host_procs

ROUTE_CHAT = CHAT.route

OTHER = {"ours": "base", "base": "ours"}


class FakeSides:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.in_flight = {"ours": 0, "base": 0}
        self.overlaps = 0

    def begin(self, request: Request, body: dict | None) -> str:
        side = request.path_params["side"]
        self.overlaps += self.in_flight[OTHER[side]] > 0
        self.in_flight[side] += 1
        self.requests.append({"side": side, "path": request.url.path, "headers": dict(request.headers), "body": body})
        return side

    def end(self, side: str) -> None:  # before the last byte goes out, so the client never sees it late
        self.in_flight[side] -= 1

    async def chat(self, request: Request):
        body = await request.json()
        side = self.begin(request, body)
        metadata = {"inference_ttft_ms": 5.0, "inference_total_ms": 9.0, "queue_ms": 1.0, "network_ms": 2.0,
                    "server_ms": 12.0, "region": "test-region", "trace_id": None}
        if not body.get("stream"):
            self.end(side)
            answer = {"choices": [{"message": {"content": "Hi"}}], "usage": {"completion_tokens": 1}}
            return JSONResponse({**answer, **({"pg_metadata": metadata} if side == "ours" else {})})

        async def events():
            for token in ["Hi", " there", "!"]:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': token}}]})}\n\n"
                await asyncio.sleep(0.001)
            usage = {"prompt_tokens": 20, "completion_tokens": 3}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            if side == "ours":
                yield pg_metadata_event(metadata, chunk_id="c", created=1, model="m", usage=usage)
            self.end(side)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(self, request: Request):
        self.end(self.begin(request, None))
        return JSONResponse({"object": "list", "data": [{"id": "qwen-3.6-35b-a3b"}]})

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", **({"region": "test-region"} if request.path_params["side"] == "ours" else {})})


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    """The host's real process table stays out of these tests: by default an empty one (no Ray)."""
    monkeypatch.setattr(bench_cli, "process_table", lambda: FakeTable(Clock(), procs=[], listening={}))


@pytest.fixture()
def fake():
    sides = FakeSides()
    app = Starlette(routes=[
        Route("/{side}/v1/chat/completions", sides.chat, methods=["POST"]),
        Route("/{side}/v1/models", sides.models),
        Route("/{side}/health", sides.health),
    ])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield sides, f"{base}/ours", f"{base}/base"
    server.should_exit = True
    thread.join(5)
    sock.close()


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("bench")(bench_cli.stream)
    app.command("bench-capacity")(bench_cli.capacity)
    return app


def test_the_serve_app_cli_has_both_commands():
    from serve_app.cli import app

    assert {"bench", "bench-capacity"} <= {c.name for c in app.registered_commands}


def test_stream_bench_writes_json_md_png(fake, tmp_path):
    sides, ours, base = fake
    args = ["bench", "--target", ours, "--baseline", base, "--runs", "3", "--concurrency", "1,2", "--ignore-eos",
            "--max-tokens", "3", "--quiet-s", "0", "--round-size", "2", "--out-dir", str(tmp_path), "--api-key", "sk-test"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    out = next(tmp_path.glob("test-region-*/qwen-3.6-35b-a3b"))  # region from ours' /health

    document = json.loads((out / "llm_bench.json").read_text())
    assert "sk-test" not in (out / "llm_bench.json").read_text()
    assert set(document["results"]) == {"1", "2"}
    level = document["results"]["2"]
    # 3 streams asked for in batches of 2: two whole batches (a last one of 1 would be a round at c=1)
    assert level["ours"]["summary"]["runs"] == level["baseline"]["summary"]["runs"] == 4
    assert level["ours"]["summary"]["errors"] == 0 and level["ours"]["batches"] == 2
    assert level["ours"]["summary"]["server_ttft_ms_p50"] == 6.0  # queue 1 + prefill 5
    assert level["baseline"]["summary"]["server_ttft_ms_p50"] is None
    assert set(level["ratios"]) >= {"aggregate_tokens_per_s", "ttft_overhead_p50"}
    assert document["meta"]["machine"]["nproc"] and document["meta"]["flags"]["runs"] == 3
    assert "api_key" not in document["meta"]["flags"]
    assert (out / "llm_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "llm_bench.md").read_text()
    assert "| End-to-end (with network) |" in markdown and "TTFT overhead p50" in markdown
    assert "TTFT overhead p50" in result.output  # the tables go to stdout too
    assert "> p95 at concurrency 2 is the slowest stream of 4 (ours) and 4 (baseline)" in markdown

    # 2 levels × 2 sides × (warm-up of 1 per worker + 3 counted, rounded up to whole batches of 2)
    chats = [r for r in sides.requests if r["path"].endswith(ROUTE_CHAT)]
    assert len(chats) == (1 + 4) * 2 + (2 + 4) * 2
    assert sides.overlaps == 0
    assert all(r["body"]["ignore_eos"] is True for r in chats)
    assert len({r["headers"]["traceparent"] for r in chats}) == len(chats)
    assert {r["headers"].get("authorization") for r in chats if r["side"] == "ours"} == {"Bearer sk-test"}
    assert not any("authorization" in r["headers"] for r in chats if r["side"] == "base")


def test_a_p95_is_called_one_streams_below_20_answered_streams_a_side():
    def level(ours: int, ours_errors: int, baseline: int) -> dict:
        return {"ours": {"summary": {"runs": ours, "errors": ours_errors}},
                "baseline": {"summary": {"runs": baseline, "errors": 0}}}

    lines = thin_tails({"1": level(21, 2, 40), "16": level(240, 0, 240), "32": level(20, 0, 20)})
    assert lines == ["> p95 at concurrency 1 is the slowest stream of 19 (ours) and 40 (baseline), not a "
                     "percentile: 20 or more a side make one (`--batch-s`, `--requests-per-worker`, `--rounds`)."]


def test_capacity_bench_writes_router_capacity(fake, tmp_path):
    sides, ours, base = fake
    args = ["bench-capacity", "--target", ours, "--baseline", base, "--concurrency", "2", "--models-requests", "6",
            "--chat-requests", "4", "--quiet-s", "0", "--out-dir", str(tmp_path), "--region", "here"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    document = json.loads(next(tmp_path.glob("here-*/qwen-3.6-35b-a3b/router_capacity.json")).read_text())
    for workload, count in (("models", 6), ("chat", 4)):
        entry = document["results"][workload]
        assert entry["ours"]["summary"]["ok"] == entry["baseline"]["summary"]["ok"] == count
        assert entry["ratios"]["requests_per_s"] is not None
    assert sides.overlaps == 0
    assert any(r["body"] and r["body"]["max_tokens"] == 1 and r["body"]["stream"] is False for r in sides.requests)
    assert "req/s" in result.output


def test_a_remote_target_is_refused(tmp_path):
    result = CliRunner().invoke(_cli(), ["bench", "--target", "https://api.yul-02.edge.polargrid.ai", "--out-dir", str(tmp_path)])
    message = " ".join(result.output.replace("│", " ").split())  # typer boxes and wraps the error
    assert result.exit_code == 2 and "only targets 127.0.0.1 / localhost" in message
    assert not any(tmp_path.iterdir())


def test_sequential_bench_target_and_report_for_bench_failover(fake, tmp_path, capsys):
    from serve_app.bench import bench_target, report

    _, ours, base = fake
    results = {"local": bench_target(ours, "m", 2, 3, 1), "failover": bench_target(base, "m", 2, 3, 0)}
    assert results["local"]["summary"]["ok"] == 2 and len(results["local"]["runs"]) == 2
    report(results, {"model": "m", "runs": 2}, tmp_path / "failover.json")
    assert "failover / local" in capsys.readouterr().out
    assert set(json.loads((tmp_path / "failover.json").read_text())["targets"]) == {"local", "failover"}


# --- CPU per token, rounds, the engine check and the gate, on a fake process table ------------
WEIGHTS = {224: 0.003, 226: 0.006, 300: 0.0015, 301: 0.006}  # CPU-seconds per request served
OURS_PIDS = {224, 226}


class ServedTable(FakeTable):
    """Our fake cluster and bare vLLM, each process charged per request its side has served."""

    def __init__(self, sides: "FakeSides", port: int):
        procs = [*host_procs(), Proc(os.getpid(), 100, ("pytest",))]
        super().__init__(Clock(), procs=procs, listening={port: {222, 300}})
        self.sides = sides
        self.envs[301] = {**self.engine_env(0, ["OMP_NUM_THREADS"]), "nice": 0}  # bare vLLM at nice 0

    def cpu_seconds(self, pid, create_time):
        side = "ours" if pid in OURS_PIDS else "base"
        served = sum(1 for r in self.sides.requests if r["side"] == side and r["path"].endswith(ROUTE_CHAT))
        return served * WEIGHTS.get(pid, 0.0)


@pytest.fixture()
def served(fake, monkeypatch):
    sides, ours, _ = fake
    table = ServedTable(sides, int(ours.split(":")[2].split("/")[0]))
    monkeypatch.setattr(bench_cli, "process_table", lambda: table)
    return fake


CPU_ARGS = ["--concurrency", "1,2", "--rounds", "2", "--requests-per-worker", "2", "--max-tokens", "3",
            "--quiet-window-s", "0.05", "--region", "here"]


def test_stream_bench_counts_cpu_per_token_per_process_and_the_spread_over_rounds(served, tmp_path):
    sides, ours, base = served
    result = CliRunner().invoke(_cli(), ["bench", "--target", ours, "--baseline", base, *CPU_ARGS,
                                         "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    out = next(tmp_path.glob("here-*/qwen-3.6-35b-a3b"))
    document = json.loads((out / "llm_bench.json").read_text())
    level = document["results"]["2"]
    # rounds of 2 requests per worker × 2 workers; every round of both sides measured
    assert [r["requests"] for r in level["ours"]["rounds"]] == [4, 4] and level["spread"]["tokens_per_s_ratio"]["n"] == 2
    cpu = level["cpu"]
    assert cpu["ours"]["tokens"] == cpu["baseline"]["tokens"] == 24
    # every process of the side is in the table, the idle ones at 0
    assert {g for g, v in cpu["ours"]["groups"].items() if v} == {"router replica", "EngineCore"}
    assert cpu["ours"]["groups"]["router replica"] == pytest.approx(1.0) and cpu["ours"]["groups"]["GCS"] == 0
    assert cpu["baseline"]["groups"] == {"API server": pytest.approx(0.5), "EngineCore": pytest.approx(2.0),
                                         "other": 0.0}
    assert cpu["ours"]["total"] == pytest.approx(3.0) and cpu["ratio_total"] == pytest.approx(1.2)
    assert level["spread"]["cpu_ratio"]["median"] == pytest.approx(1.2)
    assert level["spread"]["ttft_overhead_ms"]["n"] == 2  # both rounds paired
    assert all(r["quiet"]["timed_out"] is False for r in level["ours"]["rounds"])
    assert document["meta"]["quiet"]["floor_cores"] == 0.0
    # each side alone, and its own idle floor measured so
    assert document["meta"]["alone"] is True and set(document["meta"]["quiet"]["floors_alone"]) == {"ours", "baseline"}
    assert document["engine_env"]["mismatches"] == ["EngineCore: nice is 15 in ours, 0 in the baseline"]
    assert "WARNING: the engine does not run the same way on both sides" in result.stderr
    markdown = (out / "llm_bench.md").read_text()
    assert "> **WARNING: the engine does not run the same way on both sides**" in markdown
    for heading in ("## Ratios over rounds", "### Rounds at concurrency 2", "## CPU-seconds per 1,000 completion tokens",
                    "## Quiet before each batch (measured)", "## The engine's environment, both sides", "## On a GPU host"):
        assert heading in markdown
    # steady-load columns first (a fake batch this short may have no steady window: "—"), then the whole batch's
    assert re.search(r"\| router replica \| (—|\d+\.\d{3}) \| — \| 1\.000 \| — \|", markdown)
    assert re.search(r"\| ratio ours / baseline \| (—|\d+\.\d{3}×) \|  \| 1\.200× \|  \|", markdown)
    assert "2 requests back to back per worker per batch, 2 rounds per concurrency" in markdown
    assert "sustained tok/s ratio, median" in result.output
    assert "TTFT p50 overhead, paired by round, median" in result.output and "| ours − bare |" in markdown


def test_gate_fails_with_one_line_per_concurrency_and_writes_the_results(served, tmp_path):
    _, ours, base = served
    args = ["bench", "--target", ours, "--baseline", base, *CPU_ARGS, "--out-dir", str(tmp_path), "--gate",
            "--gate-floors", "1=10,2=10,4=0.9",  # no 10× gap between two identical fake servers
            "--quiet-floor-pct", "2"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 1
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("gate: ")]
    assert [ln.split(":")[1].strip() for ln in lines] == ["c=1", "c=2", "c=4", "engines differ"]
    assert "is below the floor 10.00×" in lines[0] and lines[2].endswith("not measured (floor 0.90×); add it to --concurrency")
    assert lines[3] == "gate: engines differ: EngineCore: nice is 15 in ours, 0 in the baseline"  # the fake's bare vLLM
    document = json.loads(next(tmp_path.glob("here-*/qwen-3.6-35b-a3b/llm_bench.json")).read_text())
    assert len(document["gate"]["failures"]) == 4
    assert document["meta"]["quiet"]["floor_cores"] == 0.02 and document["meta"]["quiet"]["threshold_cores"] == 0.07


class RealTimeClock(Clock):
    @property
    def now(self):
        return time.monotonic()

    @now.setter
    def now(self, _):
        pass


def test_a_busy_idle_floor_is_said(fake, tmp_path, monkeypatch):
    _, ours, _ = fake
    table = FakeTable(RealTimeClock(), procs=[*host_procs(), Proc(os.getpid(), 100, ("pytest",))],
                      listening={int(ours.split(":")[2].split("/")[0]): {222}}, rates={226: 0.8})
    monkeypatch.setattr(bench_cli, "process_table", lambda: table)
    args = ["bench", "--target", ours, "--concurrency", "1", "--rounds", "1", "--requests-per-worker", "1",
            "--quiet-window-s", "0.05", "--out-dir", str(tmp_path), "--region", "here"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    assert "warning: the idle floor is 80 % of a core" in result.stderr


def test_gate_needs_a_baseline_and_valid_floors(tmp_path):
    alone = CliRunner().invoke(_cli(), ["bench", "--gate", "--out-dir", str(tmp_path)])
    assert alone.exit_code == 2 and "--gate compares against a baseline" in " ".join(alone.output.split())
    bad = CliRunner().invoke(_cli(), ["bench", "--gate", "--gate-floors", "16", "--baseline", "http://127.0.0.1:1",
                                      "--out-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "concurrency=floor pairs" in " ".join(bad.output.replace("│", " ").split())
    assert not any(tmp_path.iterdir())


def test_without_ray_the_bench_still_runs_and_says_cpu_was_not_counted(fake, tmp_path):
    _, ours, base = fake  # no Ray cluster on the (fake) host
    args = ["bench", "--target", ours, "--baseline", base, "--concurrency", "1", "--rounds", "1", "--requests-per-worker",
            "1", "--quiet-s", "0", "--out-dir", str(tmp_path), "--region", "here"]
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    assert "warning: CPU not counted" in result.stderr
    document = json.loads(next(tmp_path.glob("here-*/qwen-3.6-35b-a3b/llm_bench.json")).read_text())
    assert document["meta"]["cpu"].startswith("not counted: ") and "cpu" not in document["results"]["1"]


def test_idle_command_prints_every_process_and_fails_over_the_target(monkeypatch):
    from serve_app.cli import app

    assert "idle" in {c.name for c in app.registered_commands}
    import types

    from serve_app.bench import idle

    clock = Clock()
    monkeypatch.setattr(idle, "time", types.SimpleNamespace(monotonic=clock, sleep=clock.sleep_sync))
    table = FakeTable(clock, procs=[*host_procs(), Proc(os.getpid(), 100, ("pytest",))])
    table.set_rate(220, 0.06)  # the Serve controller's loop: 6 % of a core
    monkeypatch.setattr(bench_cli, "process_table", lambda: table)
    cli = typer.Typer()
    cli.command("idle")(bench_cli.idle)
    cli.command("other")(lambda: None)
    over = CliRunner().invoke(cli, ["idle", "--seconds", "0.2"])
    assert over.exit_code == 1, over.output
    assert "| controller | ray::ServeController | 220 | 6.00 % |" in over.output and "OVER the target of 5.0 %" in over.output
    within = CliRunner().invoke(cli, ["idle", "--seconds", "0.2", "--target-pct", "7", "--json"])
    assert within.exit_code == 0 and json.loads(within.output)["total_pct"] == pytest.approx(6.0)
    lost = CliRunner().invoke(cli, ["idle", "--seconds", "0.1", "--target", "http://127.0.0.1:9"])
    assert lost.exit_code == 2 and "no Ray cluster on this host listens on port 9" in lost.stderr


def test_a_batch_smaller_than_the_concurrency_is_refused_before_anything_starts(tmp_path):
    # 16 requests a batch at concurrency 32: 16 workers, reported as 32 streams
    result = CliRunner().invoke(_cli(), ["bench", "--concurrency", "1,32", "--round-size", "16", "--baseline-vllm",
                                         "configs/local-bench.yaml", "--out-dir", str(tmp_path)])
    message = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "16 requests a batch cannot keep 32 streams in flight" in message
