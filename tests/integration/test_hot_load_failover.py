"""Hot-load and cross-region failover across two local regions on 127.0.0.1.

The session fixture deploys the ``peer`` region next to ``local`` (tests/integration/conftest.py):
the same tiny model, cold at first, one request at a time, and each region names the other as
its failover peer. Each test says which state of the peer's model it needs (the ``peer_cold`` and
``peer_loaded`` fixtures load or unload it when it is not so already), so any order works; in
file order the peer is loaded once and unloaded once. Every request goes through the official
openai SDK or plain HTTP against the real Serve proxy.
"""

import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
HF_REPO = "Qwen/Qwen3.6-35B-A3B-FP8"
MESSAGES = [{"role": "user", "content": "Say hi."}]
LOAD_TIMEOUT_S = 600  # a vLLM CPU engine next to another one on 2 cores
UNLOAD_TIMEOUT_S = 180


def _cli(serve_app, *argv: str) -> str:
    cli = str(Path(sys.executable).with_name("serve-app"))
    done = subprocess.run([cli, "--config", str(serve_app["config_path"]), *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def keys(serve_app) -> dict[str, str]:
    """API keys in the key store both regions share (tiers with room for this module's calls)."""
    return {
        "user": _cli(serve_app, "keys", "create", "--owner", "it-failover", "--tier", "standard"),
        "admin": _cli(serve_app, "keys", "create", "--owner", "it-ops", "--operator", "--tier", "standard"),
        "peer_only": _cli(
            serve_app, "keys", "create", "--owner", "it-peer-only", "--region", "peer", "--tier", "standard"
        ),
    }


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def _chat_raw(url: str, key: str, **extra):
    """A chat completion through the SDK, with its HTTP response (headers) at hand."""
    raw = _sdk(url, key).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, **extra
    )
    return raw, raw.parse()


def _card(url: str, key: str, name: str = MODEL) -> dict:
    response = httpx.get(f"{url}/v1/models/{name}", headers=_bearer(key), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for_state(url: str, key: str, wanted: str, timeout_s: float) -> list[dict]:
    """Poll the model card until ``wanted``; return every card whose state or replicas changed."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        card = _card(url, key)
        if not seen or (seen[-1]["state"], seen[-1]["replicas"]) != (card["state"], card["replicas"]):
            seen.append(card)
        if card["state"] == wanted:
            return seen
        assert card["state"] != "failed", card
        time.sleep(1)
    pytest.fail(f"{MODEL} never became {wanted}: {seen}, last card {_card(url, key)}")


def _post_forwarded(serve_app, key: str) -> httpx.Response:
    """What the local region's router sends the peer region when it fails a request over: the
    hop header, with a minute-long token for the same key whose audience is the peer alone (the
    header counts only with such a token; from a client it is ignored)."""
    from serve_app.auth.authenticator import Authenticator
    from serve_app.auth.keys import SCOPE_INFERENCE
    from serve_app.auth.ratelimit import LocalRateLimiter

    local = Authenticator(serve_app["auth"], "local", LocalRateLimiter())
    try:
        token = local.forwarding_token(local.authenticate(f"Bearer {key}", scope=SCOPE_INFERENCE), "peer")
    finally:
        local.keys.close()
    return httpx.post(
        f"{serve_app['peer_url']}/v1/chat/completions",
        headers={**_bearer(token), "x-pg-forwarded-from": "local"},
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
        timeout=60,
    )


# --- cold -----------------------------------------------------------------------------------------
def test_each_region_lists_its_models_state(serve_app, keys, peer_cold):
    local = httpx.get(f"{serve_app['base_url']}/v1/models", headers=_bearer(keys["user"])).json()["data"]
    peer = httpx.get(f"{serve_app['peer_url']}/v1/models", headers=_bearer(keys["user"])).json()["data"]
    assert [(m["id"], m["region"], m["state"]) for m in local] == [
        (MODEL, "local", "loaded"), ("qwen-3-embedding-0.6b", "local", "loaded"),  # the peer serves chat only
    ]
    assert [(m["id"], m["region"], m["state"]) for m in peer] == [(MODEL, "peer", "cold")]
    assert peer[0]["replicas"] == {"running": 0, "starting": 0, "stopping": 0}
    health = httpx.get(f"{serve_app['peer_url']}/health", timeout=30)
    assert health.status_code == 503 and health.json()["states"] == {MODEL: "cold"}


def test_a_request_for_a_model_cold_here_is_served_by_the_peer_region(serve_app, keys, peer_cold):
    raw, reply = _chat_raw(serve_app["peer_url"], keys["user"])
    assert raw.status_code == 200 and reply.choices
    assert raw.headers["x-pg-region"] == "local"
    assert raw.headers["x-pg-failover-from"] == "peer"
    assert raw.headers["x-pg-failover-reason"] == "model_cold"
    assert reply.pg_metadata["region"] == "local"  # the serving region's own timing


def test_a_stream_fails_over_too_and_ends_with_done(serve_app, keys, peer_cold):
    client = _sdk(serve_app["peer_url"], keys["user"])
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True
    ) as response:
        assert response.headers["x-pg-region"] == "local"
        chunks = list(response.parse())
    assert chunks and chunks[-1].pg_metadata["region"] == "local"


def test_a_forwarded_request_is_never_forwarded_again(serve_app, keys, peer_cold):
    response = _post_forwarded(serve_app, keys["user"])
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_cold"
    assert int(response.headers["Retry-After"]) > 0
    assert "x-pg-failover-from" not in response.headers


def test_a_caller_not_allowed_in_the_peer_region_gets_the_local_503(serve_app, keys, peer_cold):
    with pytest.raises(openai.APIStatusError) as refused:
        _chat_raw(serve_app["peer_url"], keys["peer_only"])
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "model_cold"
    assert int(refused.value.response.headers["Retry-After"]) > 0


def test_the_failover_is_one_trace_across_both_regions(serve_app, keys, peer_cold, otlp_receiver):
    trace_id = "%032x" % int(time.time() * 1e6)
    _chat_raw(serve_app["peer_url"], keys["user"], extra_headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"})
    spans = otlp_receiver["spans_for_trace"](trace_id, min_spans=7)
    servers = {s["attributes"]["serve_app.region"]: s for s in spans if s["name"] == "POST /v1/chat/completions"}
    assert set(servers) == {"peer", "local"}
    (failover,) = [s for s in spans if s["name"] == "failover"]
    assert failover["parent_span_id"] == servers["peer"]["span_id"]
    assert servers["local"]["parent_span_id"] == failover["span_id"]  # the peer continued our span
    assert failover["attributes"]["serve_app.failover.region"] == "local"
    assert failover["attributes"]["serve_app.failover.attempts"] == ["local:served:200"]
    assert servers["peer"]["attributes"]["serve_app.failover.reason"] == "model_cold"
    assert servers["peer"]["attributes"]["serve_app.served_by_region"] == "local"
    assert "Bearer" not in str(failover["attributes"])


# --- load ------------------------------------------------------------------------------------------
def test_load_and_unload_need_the_admin_scope(serve_app, keys):
    for action in ("load", "unload"):
        response = httpx.post(
            f"{serve_app['peer_url']}/v1/models/{action}", headers=_bearer(keys["user"]), json={"model": MODEL}
        )
        assert response.status_code == 403 and response.json()["error"]["code"] == "insufficient_scope"


def test_load_rejects_models_the_region_does_not_have(serve_app, keys):
    url = f"{serve_app['peer_url']}/v1/models/load"
    missing = httpx.post(url, headers=_bearer(keys["admin"]), json={"model": "qwen-3.5-27b"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    no_model = httpx.post(url, headers=_bearer(keys["admin"]), json={})
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"


def test_load_by_hf_repo_id_reports_progress_until_loaded(serve_app, keys, peer_cold):
    url = serve_app["peer_url"]
    response = httpx.post(f"{url}/v1/models/load", headers=_bearer(keys["admin"]), json={"model": HF_REPO})
    assert response.status_code == 202, response.text
    card = response.json()
    assert card["id"] == MODEL and card["state"] == "loading" and card["since"] is not None

    # While it loads, requests that cannot fail over are told to come back.
    refused = _post_forwarded(serve_app, keys["user"])
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_loading"
    assert int(refused.headers["Retry-After"]) > 0

    seen = [card["state"] for card in _wait_for_state(url, keys["user"], "loaded", LOAD_TIMEOUT_S)]
    assert seen[0] == "loading" and seen[-1] == "loaded"
    assert _card(url, keys["user"])["replicas"]["running"] == 1
    again = httpx.post(f"{url}/v1/models/load", headers=_bearer(keys["admin"]), json={"model": "qwen-3.6-a3b"})
    assert again.status_code == 200 and again.json()["state"] == "loaded"


def test_a_loaded_model_is_served_in_its_own_region(serve_app, keys, peer_loaded):
    raw, reply = _chat_raw(serve_app["peer_url"], keys["user"])
    assert raw.headers["x-pg-region"] == "peer" and "x-pg-failover-from" not in raw.headers
    assert reply.pg_metadata["region"] == "peer"


def test_an_overloaded_region_fails_over(serve_app, keys, peer_loaded):
    """The peer runs one request and queues one. With one running, of two more sent together one
    takes the queue slot and the other is shed there, so it is served by local instead."""
    url = serve_app["peer_url"]
    client = _sdk(url, keys["user"])
    started, hang_up = threading.Event(), threading.Event()

    def hold():  # a long generation (ignore_eos: random weights may emit EOS early)
        with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        ) as response:
            for _ in response.iter_lines():
                started.set()
                if hang_up.is_set():
                    break

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert started.wait(120)
        with ThreadPoolExecutor(max_workers=2) as pool:
            calls = [pool.submit(_chat_raw, url, keys["user"]) for _ in range(2)]
            done, _ = wait(calls, timeout=120, return_when=FIRST_COMPLETED)
            assert done, "neither request came back while the peer was full"
            raw, reply = next(iter(done)).result()
            assert raw.headers["x-pg-region"] == "local", "the shed request was not failed over"
            assert raw.headers["x-pg-failover-reason"] == "overloaded" and reply.choices
            hang_up.set()  # frees the peer: the queued request runs there
            served_by = sorted(call.result()[0].headers["x-pg-region"] for call in calls)
        assert served_by == ["local", "peer"]
    finally:
        hang_up.set()
        holder.join(timeout=120)


# --- unload ----------------------------------------------------------------------------------------
def test_unload_drains_to_cold_and_requests_fail_over_again(serve_app, keys, peer_loaded):
    url = serve_app["peer_url"]
    response = httpx.post(f"{url}/v1/models/unload", headers=_bearer(keys["admin"]), json={"model": MODEL})
    assert response.status_code in (200, 202), response.text
    assert response.json()["state"] in ("unloading", "cold")
    seen = _wait_for_state(url, keys["user"], "cold", UNLOAD_TIMEOUT_S)
    # Draining, never restarting: no replica starts while the model unloads.
    assert all(card["replicas"]["starting"] == 0 for card in seen), seen
    raw, _ = _chat_raw(url, keys["user"])
    assert raw.headers["x-pg-region"] == "local" and raw.headers["x-pg-failover-reason"] == "model_cold"


def test_a_response_served_by_the_peer_after_failover_is_readable_where_it_was_asked(serve_app, keys, peer_cold):
    """The Responses store is the registry's database, one for every region: a response the peer
    region's router forwarded to local (its model cold) is read, continued and deleted through the
    region the client asked (docs/operations.md, "The Responses store")."""
    origin = _sdk(serve_app["peer_url"], keys["user"])
    raw = origin.responses.with_raw_response.create(model=MODEL, input="Say hi.", max_output_tokens=8)
    assert raw.headers["x-pg-region"] == "local" and raw.headers["x-pg-failover-from"] == "peer"
    created = raw.parse()
    assert origin.responses.retrieve(created.id).output_text == created.output_text  # at the origin
    assert _sdk(serve_app["base_url"], keys["user"]).responses.retrieve(created.id).id == created.id  # and where it ran
    follow_up = origin.responses.create(model=MODEL, input="Again.", previous_response_id=created.id, max_output_tokens=4)
    assert follow_up.previous_response_id == created.id
    origin.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        _sdk(serve_app["base_url"], keys["user"]).responses.retrieve(created.id)  # gone everywhere
