"""Under contention the engine schedules by the key's tier: an enterprise request's first token
comes before a batch request's that arrived at the same moment behind a queue of batch work."""

import asyncio
import time

import httpx
import pytest

from serve_app.auth.keys import KeyStore
from serve_app.faults.traffic import chat_body, stream_chat

pytestmark = pytest.mark.integration
ENGINE_SLOTS = 16  # configs/local.yaml's max_num_seqs
FLOOD = 28  # 16 running + 12 waiting in the engine's queue, under max_ongoing_requests 32
# Lengths staggered by 25 tokens: slots free one at a time, so the queue is drained in priority
# order (equal lengths would free every slot in one step and start the whole queue at once).
FLOOD_TOKENS = 100


async def _ttft(url: str, key: str) -> float:
    """Seconds from sending one short stream to its first content chunk."""
    first = asyncio.Event()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as client:
        started = time.perf_counter()
        task = asyncio.create_task(stream_chat(client, url, chat_body(8), first_chunk=first, idle_timeout_s=300))
        await first.wait()
        ttft = time.perf_counter() - started
        outcome = await task
    assert outcome.label == "200 done", outcome
    return ttft


def test_a_higher_tier_gets_its_first_token_before_a_lower_one_under_contention(serve_app, base_url):
    store = KeyStore(serve_app["auth"].key_store())
    interactive, _ = store.create_key(owner="it-priority-enterprise", tier="enterprise")
    batch, _ = store.create_key(owner="it-priority-batch", tier="batch")

    async def scenario():
        limits = httpx.Limits(max_connections=FLOOD + 8)
        async with httpx.AsyncClient(limits=limits, headers={"Authorization": f"Bearer {batch}"}) as flood_client:
            started = [asyncio.Event() for _ in range(FLOOD)]
            flood = [
                asyncio.create_task(
                    stream_chat(flood_client, base_url, chat_body(FLOOD_TOKENS + 25 * i), first_chunk=event, idle_timeout_s=300)
                )
                for i, event in enumerate(started)
            ]
            # Every engine slot is decoding batch work and its queue holds the rest.
            while sum(event.is_set() for event in started) < ENGINE_SLOTS:
                await asyncio.sleep(0.05)
            high, low = await asyncio.gather(_ttft(base_url, interactive), _ttft(base_url, batch))
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            return high, low

    high, low = asyncio.run(scenario())
    print(f"\nTTFT under contention: enterprise {high * 1000:.0f} ms, batch {low * 1000:.0f} ms")
    assert high < low
