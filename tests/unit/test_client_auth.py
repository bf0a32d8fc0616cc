"""serve_app.client auth against fake regions on 127.0.0.1: the key → token exchange, refresh
before expiry and after a 401 ``token_expired``, the fallback to the key, and secrets kept out of
reprs and logs."""

import asyncio
import logging
import pickle
import time

import pytest

from serve_app.client import AsyncClient, AuthenticationError, Client, PolarGrid
from serve_app.client.auth import REFRESH_RETRY_S, Secret
from tests.unit.client_fake_server import MODEL, FakeRegion, error, serving

MESSAGES = [{"role": "user", "content": "Say hi in one short sentence."}]


class Skewed:
    """The client's clock, moved forward by hand: time passes for the client, not for the server,
    so the test neither sleeps nor depends on how fast a loaded machine answers."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def skew(client: AsyncClient) -> Skewed:
    clock = Skewed()
    client._auth._clock = clock
    return clock


def chat(client: AsyncClient, **extra):
    return client.chat_completion({"model": MODEL, "messages": MESSAGES, "max_tokens": 8}, **extra)


async def collect(stream) -> list[str]:
    return [c.choices[0].delta.content or "" async for c in stream]


def test_create_exchanges_the_key_and_then_sends_only_the_token():
    region = FakeRegion("a")
    with serving(region) as (url,):
        async def go():
            async with await PolarGrid.create(api_key=region.api_key, base_url=url) as client:
                assert client.auth_mode == "token"
                assert len(region.exchanges()) == 1  # at create, before any completion
                reply = await chat(client)
                assert "".join(await collect(client.chat_completion_stream({"model": MODEL, "messages": MESSAGES})))
                await client.models()
                return reply

        reply = asyncio.run(go())
    (exchange,) = region.exchanges()
    # The key goes to the exchange as its Bearer value, in no body (a traceback's locals would show it).
    assert exchange.bearer == region.api_key and not exchange.body
    bearers = {s.bearer for s in region.inference()} | {s.bearer for s in region.seen if s.path == "/v1/models"}
    assert bearers == set(region.tokens) and region.api_key not in bearers
    assert reply.choices[0].message.content == "Hi there."


def test_a_token_is_refreshed_before_it_expires_without_a_401():
    # expires_in 100 s: the 60 s margin is capped at half the lifetime, so the client refreshes at 50 s.
    region = FakeRegion("a", token_ttl_s=100)
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                clock = skew(client)
                await chat(client)
                clock.offset = 49
                await chat(client)  # not due yet: the same token
                assert 0 < client.token_expires_in <= 51
                clock.offset = 51
                await chat(client)  # due: refreshed beside this request, which the valid token serves
                await client._auth.refreshing
                await chat(client)

        asyncio.run(go())
    first, second, third, fourth = (s.bearer for s in region.inference())
    assert first == second == third != fourth and len(region.exchanges()) == 2
    assert region.statuses == [200] * 4  # refreshed ahead of time: the server never refused


def test_a_token_that_expires_mid_session_is_refreshed_without_the_caller_noticing():
    # The server expires the tokens though it said 900 s (its clock ran ahead, or we slept): the
    # client only learns from the 401, mints once and resends — for a stream too.
    region = FakeRegion("a", token_ttl_s=900)
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                await chat(client)
                region.expire_tokens()
                reply = await chat(client)
                region.expire_tokens()
                text = "".join(await collect(client.chat_completion_stream(model=MODEL, messages=MESSAGES)))
                return reply, text

        reply, text = asyncio.run(go())
    assert reply.choices[0].message.content == "Hi there." and text == "Hi there."
    assert region.statuses == [200, 401, 200, 401, 200]
    assert len(region.exchanges()) == 3


def test_a_token_is_refreshed_only_once_per_request():
    region = FakeRegion("a", server_ttl_s=0)  # every token is expired on arrival
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                with pytest.raises(AuthenticationError) as err:
                    await chat(client)
                return err.value

        err = asyncio.run(go())
    assert (err.status, err.code, err.type) == (401, "token_expired", "authentication_error")
    assert len(region.exchanges()) == 2 and region.statuses == [401, 401]


def test_concurrent_requests_share_one_refresh():
    region = FakeRegion("a", token_ttl_s=100)
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                skew(client).offset = 51  # past the refresh point
                await asyncio.gather(*(chat(client) for _ in range(5)))
                await client._auth.refreshing

        asyncio.run(go())
    assert len(region.exchanges()) == 2  # one refresh for the five
    assert len({s.bearer for s in region.inference()}) == 1  # none waited for it: the old token was valid


def test_a_failing_refresh_neither_fails_nor_stalls_requests_while_the_token_is_valid():
    # The token endpoint is down (a registry outage) in the token's last minute: requests go on
    # with the valid token, each does not wait for (or repeat) a failing exchange, and the refresh
    # is tried again after a pause.
    region = FakeRegion("a", token_ttl_s=100)
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                region.token_answers.append(error(500, "registry down", type_="server_error",
                                                  code="key_registry_unavailable"))
                clock = skew(client)
                clock.offset = 51
                await chat(client)
                await client._auth.refreshing  # failed: kept the token
                await asyncio.gather(*(chat(client) for _ in range(5)))  # within the pause: no exchange
                exchanges_during_pause = len(region.exchanges())
                clock.offset = 51 + REFRESH_RETRY_S + 1
                await chat(client)
                await client._auth.refreshing
                await chat(client)
                return exchanges_during_pause

        exchanges_during_pause = asyncio.run(go())
    assert exchanges_during_pause == 2  # the first mint and the failed refresh
    assert len(region.exchanges()) == 3 and region.statuses == [200] * 8
    bearers = [s.bearer for s in region.inference()]
    assert len(set(bearers[:7])) == 1 and bearers[7] != bearers[0]


def test_a_messages_401_for_an_expired_token_is_refreshed_like_chats():
    # Anthropic's error body has no code: the challenge (RFC 6750 invalid_token) says the token was refused.
    region = FakeRegion("a")
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                region.expire_tokens()
                return await client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES)

        message = asyncio.run(go())
    assert message.content and region.statuses == [401, 200] and len(region.exchanges()) == 2


def test_a_token_refused_after_its_signing_key_was_rotated_out_is_reminted_once():
    """docs/auth.md's key compromise: ``signing rotate``, then ``signing remove`` of the old kid:
    every token it signed is 401 invalid_token at once; clients mint anew, not at their next refresh."""
    region = FakeRegion("a")
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                await chat(client)
                region.refuse_tokens()
                await chat(client)
                await collect(client.chat_completion_stream({"model": MODEL, "messages": MESSAGES, "max_tokens": 8}))

        asyncio.run(go())
    assert region.statuses == [200, 401, 200, 200] and len(region.exchanges()) == 2


def test_requests_waiting_behind_a_failing_exchange_get_its_error_not_an_exchange_each():
    """No valid token and the token endpoint down: the requests that queued behind the exchange
    fail with it, at once, instead of each running its own exchange in turn."""
    region = FakeRegion("a", token_ttl_s=100)
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url, max_retries=0) as client:
                skew(client).offset = 101  # the token has expired by the client's clock
                region.token_answers.extend(error(503, "registry down", type_="server_error",
                                                  code="key_registry_unavailable") for _ in range(8))
                return await asyncio.gather(*(chat(client) for _ in range(8)), return_exceptions=True)

        outcomes = asyncio.run(go())
    assert all(getattr(o, "code", None) == "key_registry_unavailable" for o in outcomes), outcomes
    assert len(region.exchanges()) == 2 and region.inference() == []  # the first mint and the one that failed


def test_an_exchange_cancelled_by_its_caller_is_no_failure_for_the_requests_behind_it():
    """An exchange failed once; a later one was cancelled (its caller's timeout): the request
    queued behind it runs its own exchange, it does not get the first one's old error."""
    region = FakeRegion("a", token_ttl_s=100)
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url, max_retries=0) as client:
                clock = skew(client)
                clock.offset = 101  # expired by the client's clock: every request waits for an exchange
                region.token_answers.append(error(503, "registry down", type_="server_error",
                                                  code="key_registry_unavailable"))
                with pytest.raises(Exception, match="registry down"):
                    await chat(client)
                gate = asyncio.Event()
                exchange = client._transport.exchange

                async def slow_exchange(key):
                    await gate.wait()
                    return await exchange(key)

                client._transport.exchange = slow_exchange
                cancelled = asyncio.ensure_future(chat(client))
                while not client._auth._lock.locked():  # it holds the exchange
                    await asyncio.sleep(0)
                behind = asyncio.ensure_future(chat(client))
                for _ in range(5):  # it waits behind it
                    await asyncio.sleep(0)
                cancelled.cancel()
                gate.set()
                return await behind

        reply = asyncio.run(go())
    assert reply.choices[0].message.content == "Hi there."


def test_a_plain_text_404_on_the_token_route_is_an_error_not_a_server_without_exchange():
    """Ray's proxy answers a plain-text 404 while no application is deployed (a first deploy), as
    a corporate proxy's page would: that is no word of the router's, and the key stays off the wire."""
    from starlette.responses import PlainTextResponse

    from serve_app.client import NotFoundError

    region = FakeRegion("a")
    region.token_answers.append(PlainTextResponse("Path '/v1/auth/token' not found.", status_code=404))
    with serving(region) as (url,):
        async def go():
            with pytest.raises(NotFoundError):
                await AsyncClient.create(region.api_key, base_url=url)
            async with await AsyncClient.create(region.api_key, base_url=url) as client:  # once deployed
                assert client.auth_mode == "token"

        asyncio.run(go())
    assert region.inference() == [] and len(region.exchanges()) == 2


def test_the_key_itself_is_sent_only_when_the_server_has_no_token_exchange():
    region = FakeRegion("a", exchange=False)  # 404 not_found on /v1/auth/token, as FastAPI answers
    with serving(region) as (url,):
        async def go():
            async with await AsyncClient.create(region.api_key, base_url=url) as client:
                assert client.auth_mode == "api_key"
                await chat(client)
                await chat(client)

        asyncio.run(go())
    assert len(region.exchanges()) == 1  # asked once, not before every request
    assert [s.bearer for s in region.inference()] == [region.api_key] * 2


def test_a_wrong_key_fails_create_and_is_never_sent_as_a_bearer():
    region = FakeRegion("a")
    with serving(region) as (url,):
        async def go():
            with pytest.raises(AuthenticationError) as err:
                await AsyncClient.create("pgk_ffffffffffff_wrong", base_url=url)
            return err.value

        err = asyncio.run(go())
    assert (err.status, err.code) == (401, "invalid_api_key")
    assert region.inference() == [] and [s.path for s in region.seen] == ["/v1/auth/token"]


def test_the_sync_client_exchanges_and_refreshes_too():
    region = FakeRegion("a")
    with serving(region) as (url,):
        with Client.create(api_key=region.api_key, base_url=url) as client:
            assert client.chat_completion(model=MODEL, messages=MESSAGES).choices[0].message.content
            region.expire_tokens()
            stream = client.chat_completion_stream(model=MODEL, messages=MESSAGES)
            assert "".join(c.choices[0].delta.content or "" for c in stream) == "Hi there."
            assert stream.timing.region == "a"
    assert region.statuses == [200, 401, 200] and len(region.exchanges()) == 2


def test_neither_secret_reaches_a_repr_an_error_or_a_log(caplog):
    region = FakeRegion("a")
    caplog.set_level(logging.DEBUG)  # every logger: ours, httpx's and httpcore's
    with serving(region) as (url,):
        async def go():
            client = await AsyncClient.create(region.api_key, base_url=url)
            try:
                await chat(client)
                region.expire_tokens()
                await chat(client)  # 401 token_expired → refresh: the path that logs most
                shown = [repr(client), str(client), repr(client._auth), repr(client._auth.credential())]
                with pytest.raises(AuthenticationError) as err:
                    await AsyncClient.create(region.api_key + "x", base_url=url)
                shown += [str(err.value), repr(err.value)]
                return shown
            finally:
                await client.close()

        shown = asyncio.run(go())
    secrets_ = [region.api_key, *region.tokens]
    assert len(secrets_) == 3
    text = "\n".join(shown) + "\n" + "\n".join(r.getMessage() for r in caplog.records)
    assert caplog.records, "nothing was logged: the check would prove nothing"
    for secret in secrets_:
        assert secret not in text
        # Not even a part of it: its last 16 characters (random; splitting on "_" was not safe,
        # as url-safe base64 contains "_" and left one-letter "parts" that any log contains).
        assert secret[-16:] not in text


def test_a_secret_masks_itself_and_refuses_pickling():
    secret = Secret("pgk_0123456789ab_s3cr3t")
    assert "s3cr3t" not in repr(secret) + str(secret) + f"{secret}"
    assert secret.reveal() == "pgk_0123456789ab_s3cr3t"
    with pytest.raises(TypeError):
        pickle.dumps(secret)
