"""Request metrics reach Prometheus through Ray's metrics agent (what a scrape of the node sees)."""

import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"


def _scrape(serve_app) -> str:
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_ttft_latency_tokens_and_errors_are_exported(serve_app, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    for _ in stream:
        pass
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[], max_tokens=1)

    wanted = {
        "ray_serve_app_time_to_first_token_seconds_count": {"region": "local", "model": MODEL},
        "ray_serve_app_request_latency_seconds_count": {"model": MODEL, "status": "200"},
        "ray_serve_app_queue_time_seconds_count": {"model": MODEL},
        "ray_serve_app_output_tokens_total": {"model": MODEL},
        "ray_serve_app_errors_total": {"status": "404"},
    }
    deadline = time.monotonic() + 90  # Ray's metrics agent reports every ~10 s
    missing = wanted
    while missing and time.monotonic() < deadline:
        text = _scrape(serve_app)
        missing = {name: labels for name, labels in wanted.items() if not _sample(text, name, **labels)}
        if missing:
            time.sleep(5)
    assert not missing, f"not exported: {sorted(missing)}"
