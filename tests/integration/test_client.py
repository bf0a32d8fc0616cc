"""serve_app.client end to end: the model card's Python snippet against the real service (Serve
proxy → Router → vLLM, the session fixture in conftest.py), its timing after the stream, and a
token that expires mid-session refreshed without the caller noticing.

Token lifetimes: ``auth.token_ttl_s`` is at least 60 s (``AuthArgs``) and the session deploys
with the default 900 s, shared by every integration test, so no token expires on its own during
a test. The two refresh paths are driven instead:
- before expiry: the client's own notion of when to refresh is moved to now, so its next request
  mints first (what happens 60 s before a real token's end);
- after a real 401 ``token_expired``: the client's token is swapped for a genuinely expired one
  (same key and claims, signed with the session's keyset, ``exp`` past the leeway) while the
  client still believes it has 900 s left — a server clock ahead of the client's, or a laptop
  that slept. The router refuses it; the client mints once and resends.
"""

import time

import httpx
import jwt
import pytest

from serve_app.auth import tokens
from serve_app.auth.keys import KeyStore
from serve_app.client import Client, PolarGrid
from serve_app.client.auth import Secret
from tests.conftest import free_port

pytestmark = pytest.mark.integration

MODEL = "qwen-3.6-35b-a3b"
REGISTERED_CLAIMS = {"iss", "aud", "sub", "iat", "nbf", "exp", "jti"}


@pytest.fixture(scope="module")
def api_key(serve_app) -> str:
    """A standard-tier key in the store the routers read (as ``serve-app keys create`` makes one)."""
    key, _ = KeyStore(serve_app["auth"].key_store()).create_key(owner="it-client", tier="standard")
    return key


def _expired_like(token: str, auth) -> str:
    """A token for the same key and claims as ``token``, expired past the router's leeway."""
    claims = jwt.decode(token, options={"verify_signature": False})
    keyset = tokens.load_keyset(auth.signing_keys())
    expired, _ = tokens.mint(
        keyset,
        issuer=auth.issuer,
        audience=auth.audience,
        subject=claims["sub"],
        ttl_s=60,
        claims={k: v for k, v in claims.items() if k not in REGISTERED_CLAIMS},
        not_after=int(time.time()) - auth.leeway_s - 60,
    )
    return expired


@pytest.mark.anyio
@pytest.mark.parametrize("credential", ["api_key", "dev_key"])
async def test_the_model_cards_snippet_streams_and_its_timing_is_readable_after(request, base_url, credential):
    key = request.getfixturevalue(credential)
    # The model card's snippet; changed: the import and base_url (and the stream kept in a name).
    client = await PolarGrid.create(api_key=key, base_url=base_url)
    try:
        stream = client.chat_completion_stream({
            "model": "qwen-3.6-35b-a3b",
            "messages": [{"role": "user", "content": "Say hi in one short sentence."}],
            "max_tokens": 32,
        })
        chunks = 0
        async for chunk in stream:
            content = chunk.choices[0].delta.content
            if content:
                print(content, end="", flush=True)
            chunks += 1
        assert client.auth_mode == "token"  # the key was exchanged, the token sent
    finally:
        await client.close()
    assert chunks > 0 and stream.ended
    timing = stream.timing
    assert timing is not None and timing.region == stream.region == "local"
    assert timing.inference_ttft_ms > 0 and timing.inference_total_ms >= timing.inference_ttft_ms
    assert timing.queue_ms >= 0 and timing.network_ms >= 0
    split = timing.network_ms + timing.queue_ms + timing.inference_total_ms
    assert abs(split - timing.server_ms) < 0.01
    assert timing.model == MODEL and timing.trace_id == stream.trace_id  # the server joined our trace


@pytest.mark.anyio
async def test_a_token_due_for_refresh_is_refreshed_before_the_next_request(base_url, api_key):
    async with await PolarGrid.create(api_key=api_key, base_url=base_url) as client:
        first = client._auth.credential()
        assert 800 < client.token_expires_in <= 900  # the session's token_ttl_s
        client._auth._refresh_at = time.monotonic()  # "60 s before the end" is now
        reply = await client.chat_completion(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert reply.choices and client._auth.credential() is not first
        assert client._auth.exchanges == 2


@pytest.mark.anyio
async def test_a_token_that_expired_mid_session_is_refreshed_without_the_caller_noticing(base_url, api_key, serve_app):
    messages = [{"role": "user", "content": "Say hi."}]
    async with await PolarGrid.create(api_key=api_key, base_url=base_url) as client:
        assert (await client.chat_completion(model=MODEL, messages=messages, max_tokens=2)).choices
        expired = _expired_like(client._auth.credential().reveal(), serve_app["auth"])
        # The precondition, from the router itself: this token is refused as expired.
        refused = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {expired}"}, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "token_expired"

        for call in ("json", "stream"):
            client._auth._token = Secret(expired)  # the client still thinks it has ~900 s left
            if call == "json":
                reply = await client.chat_completion(model=MODEL, messages=messages, max_tokens=2)
                assert reply.choices and reply.timing.region == "local"
            else:
                stream = client.chat_completion_stream(model=MODEL, messages=messages, max_tokens=2)
                assert [chunk async for chunk in stream] and stream.timing.inference_total_ms is not None
            assert client._auth.credential().reveal() != expired
        assert client._auth.exchanges == 3  # create, then one refresh per refused request


def test_the_sync_client_fails_over_from_a_dead_url_and_reports_the_region(base_url, api_key):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect refused at once
    with Client.create(api_key=api_key, base_urls=[dead, base_url]) as client:
        reply = client.chat_completion({"model": "qwen-3.6-a3b", "messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 2})
        assert reply.model == MODEL and reply.timing.region == "local"
        assert set(reply.timing.server_timing) >= {"network", "total"}
        models = client.models()
        assert MODEL in [m.id for m in models.data]
        completion = client.completion(model=MODEL, prompt="Hello", max_tokens=4)
        assert completion.choices and completion.timing.trace_id


def _assert_split(timing, stream) -> None:
    assert timing is not None and timing.region == "local" and timing.trace_id == stream.trace_id
    assert timing.inference_ttft_ms > 0 and timing.inference_total_ms >= timing.inference_ttft_ms
    assert abs(timing.network_ms + timing.queue_ms + timing.inference_total_ms - timing.server_ms) < 0.01


@pytest.mark.anyio
async def test_the_responses_and_messages_snippets_stream_with_their_timing(base_url, api_key):
    """docs/client.md's two snippets: each stream ends at its terminal event with the timing read
    from inside it; a conversation continues; a stored response is retrieved and deleted."""
    async with await PolarGrid.create(api_key=api_key, base_url=base_url) as client:
        stream = client.responses.stream({"model": MODEL, "input": "Say hi in one short sentence.",
                                          "max_output_tokens": 32, "temperature": 0})
        kinds = [event.type async for event in stream]
        assert kinds[-1] in ("response.completed", "response.incomplete") and stream.ended
        _assert_split(stream.timing, stream)
        first = stream.response
        assert first.output_text and first.timing is stream.timing
        second = await client.responses.create(model=MODEL, input="And in French?", previous_response_id=first.id,
                                               max_output_tokens=16)
        assert second.previous_response_id == first.id and second.timing.server_ms > 0
        assert (await client.responses.retrieve(second.id)).output_text == second.output_text
        assert (await client.responses.delete(first.id)).deleted

        # Greedy, as the stream above: a sampled tiny-model answer is empty now and then.
        request = {"model": MODEL, "max_tokens": 32, "temperature": 0,
                   "messages": [{"role": "user", "content": "Say hi."}]}
        counted = await client.messages.count_tokens(model=MODEL, messages=request["messages"])
        messages = client.messages.stream(request)
        events = [event async for event in messages]
        assert events[0].type == "message_start" and events[-1].type == "message_stop"
        _assert_split(messages.timing, messages)
        message = await client.messages.create(request)
        assert message.content[0].text and message.usage.input_tokens == counted.input_tokens > 0
        assert message.timing.inference_total_ms is not None
