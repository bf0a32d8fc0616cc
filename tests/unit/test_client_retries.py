"""serve_app.client retries, failover and timeouts against fake regions on 127.0.0.1: 503 and 429
honouring Retry-After, bounded in count and time; failover between two local regions on 503 and
on a refused connection, for streams too; timeouts not retried; one connection reused."""

import asyncio
import time

import pytest

from serve_app.client import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    InternalServerError,
    RateLimitError,
    ServiceUnavailableError,
)
from tests.unit.client_fake_server import FakeRegion, dead_url, error, serving, unavailable

REQUEST = {"model": "qwen-3.6-35b-a3b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def run(regions: list[FakeRegion], scenario, *, extra_urls=(), **options):
    """Serve ``regions``; a client over ``extra_urls`` + their URLs (in that order) runs ``scenario``."""
    with serving(*regions) as urls:
        async def go():
            key = regions[0].api_key
            for region in regions[1:]:
                # One key and one keyset: every region accepts the key and each other's tokens.
                region.api_key, region.tokens = key, regions[0].tokens
            async with await AsyncClient.create(key, base_urls=[*extra_urls, *urls], **options) as client:
                return await scenario(client)

        return asyncio.run(go())


def timed(coro_fn):
    async def scenario(client):
        started = time.monotonic()
        result = await coro_fn(client)
        return result, time.monotonic() - started
    return scenario


def test_a_503_is_retried_after_its_retry_after():
    region = FakeRegion("a")
    region.answers.append(unavailable(retry_after="1"))
    reply, elapsed = run([region], timed(lambda c: c.chat_completion(REQUEST)))
    assert reply.choices[0].message.content == "Hi there."
    assert region.statuses == [503, 200]
    assert 1.0 <= elapsed < 2.5  # waited what the server asked, not the 0.5 s backoff


def test_a_retry_woken_before_the_clock_says_it_is_due_still_asks_a_region():
    """A coarse monotonic clock (15.6 ms ticks: Windows, Python 3.11) can read a retry's wake-up as
    before its due time: the first region due is asked then, never none (an IndexError)."""
    region = FakeRegion("a")
    region.answers.append(unavailable(retry_after=None))

    async def scenario(client):
        client._transport._clock = lambda: 1000.0  # no time passes by this clock: every wake-up is early
        return await client.chat_completion(REQUEST)

    reply = run([region], scenario)
    assert reply.choices[0].message.content == "Hi there." and region.statuses == [503, 200]


def test_a_429_is_retried_after_retry_after_ms():
    region = FakeRegion("a")
    region.answers.append(error(429, "Rate limit reached", type_="rate_limit_error", code="rate_limit_exceeded",
                                headers={"Retry-After": "3", "retry-after-ms": "200"}))
    _, elapsed = run([region], timed(lambda c: c.chat_completion(REQUEST)))
    assert region.statuses == [429, 200] and 0.2 <= elapsed < 2.5  # not Retry-After's 3 s


def test_a_429_waits_for_the_same_region_rather_than_failing_over():
    # The budget is the caller's key's: another region would charge it too.
    first, second = FakeRegion("yul-02"), FakeRegion("yvr-01")
    first.answers.append(error(429, "Rate limit reached", type_="rate_limit_error", code="rate_limit_exceeded",
                               headers={"retry-after-ms": "100"}))

    async def scenario(client):
        return await client.chat_completion(REQUEST)

    reply = run([first, second], scenario)
    assert reply.timing.region == "yul-02" and first.statuses == [429, 200] and second.statuses == []


def test_retries_are_bounded_in_count_and_the_last_error_is_raised():
    region = FakeRegion("a")
    region.answers += [unavailable(retry_after="0")] * 5

    async def scenario(client):
        with pytest.raises(ServiceUnavailableError) as err:
            await client.chat_completion(REQUEST)
        return err.value

    err = run([region], scenario, max_retries=2)
    assert region.statuses == [503, 503, 503]  # the first try and two retries
    assert (err.status, err.type, err.code, err.retry_after, err.region) == (503, "service_unavailable", "overloaded", 0, "a")


def test_a_retry_after_beyond_the_time_budget_is_raised_at_once():
    region = FakeRegion("a")
    region.answers.append(unavailable(retry_after="60", code="model_cold"))

    async def scenario(client):
        with pytest.raises(ServiceUnavailableError) as err:
            await client.chat_completion(REQUEST)
        return err.value

    err, elapsed = run([region], timed(scenario), max_retry_time_s=5)
    assert (err.code, err.retry_after) == ("model_cold", 60) and elapsed < 5
    assert region.statuses == [503]


def test_max_retries_zero_never_waits():
    region = FakeRegion("a")
    region.answers.append(error(429, "slow down", type_="rate_limit_error", code="rate_limit_exceeded",
                                headers={"Retry-After": "1"}))

    async def scenario(client):
        with pytest.raises(RateLimitError) as err:
            await client.chat_completion(REQUEST)
        return err.value

    err = run([region], scenario, max_retries=0)
    assert (err.status, err.retry_after) == (429, 1) and region.statuses == [429]


def test_a_503_fails_over_to_the_next_region_at_once_and_reports_who_served():
    first, second = FakeRegion("yul-02"), FakeRegion("yvr-01")
    first.answers.append(unavailable(retry_after="2"))

    async def scenario(client):
        started = time.monotonic()
        reply = await client.chat_completion(REQUEST)
        elapsed = time.monotonic() - started
        again = await client.chat_completion(REQUEST)  # yul-02 said 2 s: it is held until then
        return reply, again, elapsed

    reply, again, elapsed = run([first, second], scenario)
    assert reply.timing.region == again.timing.region == "yvr-01"
    assert elapsed < 1.8  # no wait between regions (yul-02 asked for 2 s)
    assert first.statuses == [503] and second.statuses == [200, 200]


def test_with_several_regions_none_is_asked_again_before_its_own_retry_after():
    first, second = FakeRegion("yul-02"), FakeRegion("yvr-01")
    first.answers.append(unavailable(retry_after="1"))
    second.answers += [unavailable(retry_after="0.2"), unavailable(retry_after="5")]

    async def scenario(client):
        return await client.chat_completion(REQUEST)

    reply, elapsed = run([first, second], timed(scenario), max_retries=3)
    # yul-02 said 1 s and yvr-01 0.2 s: after 0.2 s only yvr-01 is asked; yul-02 at 1 s.
    assert reply.timing.region == "yul-02" and first.statuses == [503, 200] and second.statuses == [503, 503]
    assert 1.0 <= elapsed < 4.0  # not yvr-01's second 5 s


def test_a_refused_connection_fails_over_and_the_dead_region_is_held_back():
    region = FakeRegion("yvr-01")
    dead = dead_url()

    async def scenario(client):
        stream = client.chat_completion_stream(REQUEST)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        held = client._transport._order()
        return text, stream.region, held

    text, served_by, held = run([region], scenario, extra_urls=[dead])
    assert text == "Hi there." and served_by == "yvr-01"
    assert held == [1, 0]  # the dead URL goes last for region_hold_s
    assert region.statuses == [200]


def test_when_every_region_is_down_the_connection_error_is_raised_after_the_retries():
    async def go():
        client = AsyncClient("pgk_0123456789ab_x", base_urls=[dead_url(), dead_url()], max_retries=1)
        started = time.monotonic()
        try:
            with pytest.raises(APIConnectionError) as err:
                await client.chat_completion(REQUEST)  # the exchange is the first request that fails
        finally:
            await client.close()
        return err.value, time.monotonic() - started

    err, elapsed = asyncio.run(go())
    assert "cannot connect" in err.message and elapsed < 3


def test_a_read_timeout_is_raised_and_not_resent():
    region = FakeRegion("a")

    async def scenario(client):
        with pytest.raises(APITimeoutError):
            await client.chat_completion(REQUEST, timeout=0.3)

    def answer(seen):
        time.sleep(0.8)  # blocks this fake region's loop: no byte for longer than the timeout
        return error(500, "late", type_="server_error")

    region.answers.append(answer)
    run([region], scenario)
    assert len(region.inference()) == 1


def test_one_connection_is_reused_across_requests():
    region = FakeRegion("a")

    async def scenario(client):
        for _ in range(4):
            await client.chat_completion(REQUEST)

    ports = []
    original = region._record

    async def record(request):
        ports.append(request.client.port)  # the client's side of the TCP connection
        return await original(request)

    region._record = record
    run([region], scenario)
    assert len(ports) == 5 and len(set(ports)) == 1  # the exchange and four completions


def test_a_region_whose_haproxy_has_no_router_fails_over_like_a_503():
    # HAProxy's 500 gateway_unavailable: no router took the request, so nothing ran anywhere.
    first, second = FakeRegion("yul-02"), FakeRegion("yvr-01")
    first.answers.append(error(500, "no router could take this request; retry", type_="server_error",
                               code="gateway_unavailable"))

    async def scenario(client):
        reply = await client.chat_completion(REQUEST)
        return reply, client._transport._order()

    reply, order = run([first, second], scenario)
    assert reply.timing.region == "yvr-01" and first.statuses == [500] and second.statuses == [200]
    assert order == [1, 0]  # held back like a region that answered 503


def test_a_500_that_may_have_run_is_raised_not_failed_over():
    first, second = FakeRegion("yul-02"), FakeRegion("yvr-01")
    first.answers.append(error(500, "the router failed while answering", type_="server_error", code="gateway_failed"))

    async def scenario(client):
        with pytest.raises(InternalServerError) as err:
            await client.chat_completion(REQUEST)
        return err.value

    assert run([first, second], scenario).code == "gateway_failed" and second.statuses == []


def test_a_429_waits_its_own_retry_after_whatever_a_region_before_it_said():
    first, second = FakeRegion("yul-02"), FakeRegion("yvr-01")
    first.answers += [unavailable(retry_after="0.1")] * 3
    second.answers.append(error(429, "Rate limit reached", type_="rate_limit_error", code="rate_limit_exceeded",
                                headers={"Retry-After": "1"}))
    reply, elapsed = run([first, second], timed(lambda c: c.chat_completion(REQUEST)))
    assert reply.timing.region == "yvr-01" and second.statuses == [429, 200] and first.statuses == [503]
    assert elapsed >= 1.0  # yvr-01's own second, not yul-02's 0.1
