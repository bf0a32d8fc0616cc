"""``serve-app bench`` and ``bench-capacity`` end to end against a fake OpenAI server on 127.0.0.1.

One uvicorn server in a thread plays both sides: ``/ours/...`` streams with a ``pg_metadata``
event and a region in ``/health`` (as our router does), ``/base/...`` like bare vLLM (no
metadata). It records every request and whether the other side had one in flight.
"""

import asyncio
import json
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
from serve_app.surfaces import CHAT
from serve_app.surfaces.dialects import pg_metadata_event

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
    assert level["ours"]["summary"]["runs"] == level["baseline"]["summary"]["runs"] == 3
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

    # 2 levels × 2 sides × (warm-up of 1 per worker + 3 counted)
    chats = [r for r in sides.requests if r["path"].endswith(ROUTE_CHAT)]
    assert len(chats) == (1 + 3) * 2 + (2 + 3) * 2
    assert sides.overlaps == 0
    assert all(r["body"]["ignore_eos"] is True for r in chats)
    assert len({r["headers"]["traceparent"] for r in chats}) == len(chats)
    assert {r["headers"].get("authorization") for r in chats if r["side"] == "ours"} == {"Bearer sk-test"}
    assert not any("authorization" in r["headers"] for r in chats if r["side"] == "base")


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
