"""The usage ledger end to end: two regions, one registry on a real PostgreSQL server, real vLLM.

Every admitted inference request is recorded once, by the region that served it, with the tokens
the engine really handled: 64 streams give 64 rows whose counts match each stream's own usage; a
stream abandoned mid-way is recorded with what was generated, not zero and not its budget; a
failed-over request is recorded once. Budgets are enforced from that ledger in every region, and
``GET /v1/usage`` and ``serve-app usage`` report it.
"""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_app.auth.database import open_database
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, KeyStore
from serve_app.router.pricing import estimate_prompt_tokens
from serve_app.usage.store import UsageStore

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
ASK = [{"role": "user", "content": "Count."}]
STREAMS = 64
CONCURRENCY = 16
# Records are written within the ledger's flush interval (1 s); a little more for the batch.
WRITTEN_WITHIN_S = 15


@pytest.fixture(scope="module")
def registry(serve_app):
    location = serve_app["auth"].key_store()
    return KeyStore(location, cache_ttl_s=0), UsageStore(open_database(location))


def _new_key(registry, owner: str, **kwargs) -> tuple[str, str]:
    keys, _ = registry
    key, record = keys.create_key(owner=owner, tier="standard", **kwargs)
    return key, record.key_id


def _rows(registry, key_id: str, expected: int) -> list[dict]:
    """The key's usage rows once ``expected`` of them are written (and never more)."""
    _, usage = registry
    deadline = time.monotonic() + WRITTEN_WITHIN_S
    while True:
        with usage.database.connect() as db:
            rows = [dict(row) for row in db.execute("SELECT * FROM usage_records WHERE key_id = ?", (key_id,)).fetchall()]
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _sdk(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def test_64_streams_record_one_row_each_with_the_tokens_each_stream_reported(serve_app, registry):
    key, key_id = _new_key(registry, "it-usage-64")
    client = _sdk(serve_app["base_url"], key)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def stream(max_tokens: int) -> dict:
        async with gate:
            chunks = await client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            usage = None
            async for chunk in chunks:
                usage = chunk.usage or usage
            return usage.model_dump()

    async def run() -> list[dict]:
        return await asyncio.gather(*(stream(n) for n in range(1, STREAMS + 1)))

    reported = asyncio.run(run())
    rows = _rows(registry, key_id, STREAMS)
    assert len(rows) == STREAMS and len({row["id"] for row in rows}) == STREAMS
    # ignore_eos: each stream generated exactly its max_tokens, 1..64, and its row says so.
    assert sorted(row["completion_tokens"] for row in rows) == list(range(1, STREAMS + 1))
    assert sorted((u["prompt_tokens"], u["completion_tokens"]) for u in reported) == sorted(
        (row["prompt_tokens"], row["completion_tokens"]) for row in rows
    )
    assert {(row["status"], row["region"], row["model"], row["failover_origin"]) for row in rows} == {
        (200, "local", MODEL, None)
    }
    assert {row["finish_reason"] for row in rows} == {"length"}
    assert all(row["ended_at_ms"] >= row["started_at_ms"] for row in rows)
    # The key's own report is the same ledger, rolled up.
    report = httpx.get(f"{serve_app['base_url']}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert report.status_code == 200, report.text
    totals = report.json()["totals"]
    assert totals["requests"] == STREAMS
    assert totals["completion_tokens"] == STREAMS * (STREAMS + 1) // 2


def test_an_abandoned_stream_is_recorded_with_the_tokens_generated_before_the_client_left(serve_app, registry):
    key, key_id = _new_key(registry, "it-usage-abandoned")
    budget, read = 4000, 5
    request = {
        "model": MODEL, "messages": ASK, "max_tokens": budget, "stream": True, "ignore_eos": True,
    }
    seen = 0
    with httpx.stream(
        "POST", f"{serve_app['base_url']}/v1/chat/completions", json=request,
        headers={"Authorization": f"Bearer {key}"}, timeout=60,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            # A token's chunk: its delta has content (the first chunk carries the role only).
            if line.startswith("data: ") and '"content"' in line and '"role"' not in line:
                seen += 1
                if seen == read:
                    break  # leave: the connection closes with the block
    (row,) = _rows(registry, key_id, 1)
    assert row["status"] == 499 and row["finish_reason"] is None
    # What the engine generated before it stopped: at least what the client read, and far from
    # the budget it was allowed (the hang-up stops the engine at once, not at max_tokens).
    assert read <= row["completion_tokens"] < budget // 2
    assert row["prompt_tokens"] > 0


def test_a_failed_over_request_is_recorded_once_by_the_region_that_served_it(serve_app, registry, peer_cold):
    key, key_id = _new_key(registry, "it-usage-failover")
    peer = _sdk(serve_app["peer_url"], key)

    async def ask():
        return await peer.chat.completions.with_raw_response.create(
            model=MODEL, messages=ASK, max_tokens=3, extra_body={"ignore_eos": True}
        )

    raw = asyncio.run(ask())
    assert raw.status_code == 200
    # The peer region's model is cold (peer_cold): local serves.
    assert raw.headers["x-pg-failover-from"] == "peer" and raw.headers["x-pg-region"] == "local"
    time.sleep(2)  # both regions' ledgers have flushed: a second row would be there by now
    (row,) = _rows(registry, key_id, 2)
    assert (row["region"], row["failover_origin"], row["status"]) == ("local", "peer", 200)
    assert row["completion_tokens"] == raw.parse().usage.completion_tokens == 3


def test_a_budget_is_enforced_in_every_region_from_the_shared_ledger(serve_app, registry):
    key, key_id = _new_key(registry, "it-usage-budget")
    _, usage = registry
    usage.set_budget(key_id, tokens_per_day=60, tokens_per_month=None)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": ASK, "max_tokens": 20, "ignore_eos": True}
    url = f"{serve_app['base_url']}/v1/chat/completions"
    first = httpx.post(url, json=body, headers=headers, timeout=60)
    assert first.status_code == 200, first.text
    assert first.headers["x-budget-limit-tokens-day"] == "60"
    spent = first.json()["usage"]["total_tokens"]
    assert int(first.headers["x-budget-remaining-tokens-day"]) == 60  # checked before this one ran
    # Two router replicas serve this region: one may admit until the other's spend is written
    # and its cache expires (the documented overshoot), so ask until refused, within that bound.
    answers, deadline = [first], time.monotonic() + WRITTEN_WITHIN_S
    while answers[-1].status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        answers.append(httpx.post(url, json=body, headers=headers, timeout=60))
    refused = answers[-1]
    assert refused.status_code == 429, [a.status_code for a in answers]
    assert refused.json()["error"]["code"] == "budget_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    # Escrow: refused once what is left can no longer hold the request's worst case, its prompt
    # as the router estimates it (from the body's size) plus its 20-token limit.
    worst_case = estimate_prompt_tokens(len(refused.request.content)) + body["max_tokens"]
    assert spent * (len(answers) - 1) + worst_case > 60
    assert worst_case <= 60  # ...and the first fit the whole budget: it was admitted
    # The peer region reads the same ledger: refused there too, whatever its model's state.
    deadline = time.monotonic() + WRITTEN_WITHIN_S
    while True:
        there = httpx.post(f"{serve_app['peer_url']}/v1/chat/completions", json=body, headers=headers, timeout=60)
        if there.status_code == 429 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert there.status_code == 429 and there.json()["error"]["code"] == "budget_exceeded"


def test_usage_reports_are_a_keys_own_unless_admin(serve_app, registry):
    key, key_id = _new_key(registry, "it-usage-report")
    other, _ = _new_key(registry, "it-usage-report-other")
    admin, _ = _new_key(registry, "it-usage-admin", scopes=(SCOPE_INFERENCE, SCOPE_ADMIN, SCOPE_OPERATOR))
    base = serve_app["base_url"]
    assert httpx.post(
        f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
        json={"model": MODEL, "messages": ASK, "max_tokens": 2, "ignore_eos": True},
    ).status_code == 200
    _rows(registry, key_id, 1)
    own = httpx.get(f"{base}/v1/usage", params={"group_by": "model,region"}, headers={"Authorization": f"Bearer {key}"})
    assert own.status_code == 200
    assert [(r["model"], r["region"], r["requests"]) for r in own.json()["data"]] == [(MODEL, "local", 1)]
    # Another key's usage is an admin's business only.
    prying = httpx.get(f"{base}/v1/usage", params={"key_id": key_id}, headers={"Authorization": f"Bearer {other}"})
    assert prying.status_code == 403
    as_admin = httpx.get(
        f"{base}/v1/usage", params={"key_id": key_id, "format": "csv"}, headers={"Authorization": f"Bearer {admin}"}
    )
    assert as_admin.status_code == 200 and as_admin.headers["content-type"].startswith("text/csv")
    assert as_admin.text.splitlines()[0].startswith("day,requests")
    bad = httpx.get(f"{base}/v1/usage", params={"since": "yesterday"}, headers={"Authorization": f"Bearer {key}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
    # The operator's CLI reads the same registry.
    cli = str(Path(sys.executable).with_name("serve-app"))
    done = subprocess.run(
        [cli, "--config", str(serve_app["config_path"]), "usage", "report", "--key", key_id, "--format", "json"],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["totals"]["requests"] == 1
