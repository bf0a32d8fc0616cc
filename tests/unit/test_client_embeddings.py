"""``client.embeddings.create`` (async and sync) against fake regions on 127.0.0.1: floats by
default over base64 on the wire, as the openai SDK does; the server's format when one is named;
timing; a 503 failed over to the next region; a refusal raised with its param."""

import asyncio

import pytest

from serve_app.client import AsyncClient, BadRequestError, Client, CreateEmbeddingResponse
from tests.unit.client_fake_server import FakeRegion, error, serving, unavailable

EMBED = "qwen-3-embedding-0.6b"


def run(regions: list[FakeRegion], scenario):
    with serving(*regions) as urls:
        async def go():
            key = regions[0].api_key
            for region in regions[1:]:
                region.api_key, region.tokens = key, regions[0].tokens
            async with await AsyncClient.create(key, base_urls=urls) as client:
                return await scenario(client)

        return asyncio.run(go())


def test_a_call_without_a_format_gets_floats_over_base64_with_the_servers_timing():
    region = FakeRegion("a")
    reply = run([region], lambda c: c.embeddings.create(model=EMBED, input=["one", "two"]))
    assert isinstance(reply, CreateEmbeddingResponse)
    assert [item.embedding for item in reply.data] == [[0.5, -0.25, 1.0], [0.5, -0.25, 2.0]]
    assert (reply.model, reply.usage.prompt_tokens, reply.usage.total_tokens) == (EMBED, 4, 4)
    (seen,) = region.inference()
    assert seen.path == "/v1/embeddings"
    assert seen.body == {"model": EMBED, "input": ["one", "two"], "encoding_format": "base64"}
    assert (reply.timing.region, reply.timing.inference_total_ms) == ("a", 20.0)
    assert reply.timing.server_timing["inference"] == 20.0 and reply.timing.trace_id == seen.trace_id


@pytest.mark.parametrize("encoding_format, first", [("float", [0.5, -0.25, 1.0]), ("base64", "AAAAPwAAgL4AAIA/")])
def test_a_named_format_is_sent_and_returned_as_the_server_sent_it(encoding_format, first):
    region = FakeRegion("a")
    request = {"model": EMBED, "input": "one", "encoding_format": encoding_format}
    reply = run([region], lambda c: c.embeddings.create(request))
    assert reply.data[0].embedding == first
    assert region.inference()[0].body == request


def test_a_503_fails_over_to_the_next_region():
    busy, other = FakeRegion("a"), FakeRegion("b")
    busy.answers.append(unavailable(retry_after="30"))
    reply = run([busy, other], lambda c: c.embeddings.create(model=EMBED, input="one"))
    assert reply.timing.region == "b" and busy.statuses == [503] and other.statuses == [200]


def test_a_refusal_is_raised_with_its_param_and_never_retried():
    region = FakeRegion("a")
    region.answers.append(error(400, "invalid request: input: an empty string has no embedding",
                                type_="invalid_request_error", param="input"))
    with pytest.raises(BadRequestError) as refused:
        run([region], lambda c: c.embeddings.create(model=EMBED, input=""))
    assert refused.value.param == "input" and region.statuses == [400]


def test_the_sync_client_embeds_the_same_way():
    region = FakeRegion("a")
    with serving(region) as urls:
        with Client.create(region.api_key, base_url=urls[0]) as client:
            reply = client.embeddings.create(model=EMBED, input="one")
    assert reply.data[0].embedding == [0.5, -0.25, 1.0] and reply.timing.region == "a"
