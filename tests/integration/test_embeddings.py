"""``POST /v1/embeddings`` end to end: the official openai SDK → HAProxy → Router → the embedding
model's ModelServer → vLLM's pooling runner (CPU) on the tiny Qwen3 embedding checkpoint
(``serve_app/devtools/tiny_embedding_model.py``), beside the chat model (configs/local.yaml).

Float and base64 (the SDK's default, decoded by the SDK), ``dimensions``, token-id input, the
model's state in ``/v1/models``, one usage record in the ledger with the engine's prompt tokens,
and the refusals a strict client meets. Run by the lead (never on a shared 2-CPU host at will).
"""

import math
import time

import httpx
import openai
import pytest

from serve_app.auth.database import open_database
from serve_app.auth.keys import KeyStore
from serve_app.usage.store import UsageStore

pytestmark = pytest.mark.integration

EMBED = "qwen-3-embedding-0.6b"
DIMENSIONS = 128  # the tiny checkpoint's hidden size
WRITTEN_WITHIN_S = 15  # the ledger writes within its 1 s flush interval; a margin for the batch


@pytest.fixture(scope="module")
def user(serve_app):
    keys = KeyStore(serve_app["auth"].key_store(), cache_ttl_s=0)
    key, record = keys.create_key(owner="it-embeddings", tier="standard")
    client = openai.OpenAI(base_url=f"{serve_app['base_url']}/v1", api_key=key, max_retries=0, timeout=120)
    return client, key, record.key_id


def _norm(vector) -> float:
    return math.sqrt(sum(v * v for v in vector))


def test_float_embeddings_through_the_official_sdk(user):
    client, _, _ = user
    reply = client.embeddings.create(model=EMBED, input=["the same text", "the same text", "another text"],
                                     encoding_format="float")
    assert reply.object == "list" and reply.model == EMBED
    vectors = [item.embedding for item in reply.data]
    assert [item.index for item in reply.data] == [0, 1, 2]
    assert all(len(v) == DIMENSIONS for v in vectors)
    assert vectors[0] == pytest.approx(vectors[1], abs=1e-3)  # the same text, the same vector
    assert vectors[0] != pytest.approx(vectors[2], abs=1e-3)
    assert all(_norm(v) == pytest.approx(1.0, abs=1e-3) for v in vectors)  # last-token pooling, normalised
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0


def test_base64_embeddings_decode_to_the_float_vectors(user):
    client, _, _ = user
    as_float = client.embeddings.create(model=EMBED, input="a text to embed", encoding_format="float")
    # The SDK's default: it asks for base64 and decodes it (little-endian float32) itself.
    by_default = client.embeddings.create(model=EMBED, input="a text to embed")
    raw = client.embeddings.with_raw_response.create(model=EMBED, input="a text to embed", encoding_format="base64")
    assert isinstance(raw.http_response.json()["data"][0]["embedding"], str)
    assert by_default.data[0].embedding == pytest.approx(as_float.data[0].embedding, abs=1e-6)


def test_dimensions_and_token_ids(user):
    client, _, _ = user
    short = client.embeddings.create(model=EMBED, input=[[11, 12, 13], [14, 15]], dimensions=32,
                                     encoding_format="float")
    assert [len(item.embedding) for item in short.data] == [32, 32]
    assert all(_norm(item.embedding) == pytest.approx(1.0, abs=1e-3) for item in short.data)
    assert short.usage.prompt_tokens == 5  # token ids are counted as given


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "x", "dimensions": 4096}, "dimensions"),
    ({"input": [[999_999]]}, "input"),
    ({"input": "x", "normalize": False}, "normalize"),
])
def test_what_openai_refuses_is_a_400_naming_the_field(serve_app, user, body, param):
    _, key, _ = user
    response = httpx.post(f"{serve_app['base_url']}/v1/embeddings", json={"model": EMBED, **body},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_request_over_300000_tokens_in_all_is_a_400_before_the_engine_runs_it(serve_app, user):
    """The router counts token-id inputs, but only estimates text (4 bytes a token): a text its
    tokenizer splits finer passes the router and is refused by the replica on its rendered inputs."""
    _, key, _ = user
    headers = {"Authorization": f"Bearer {key}"}
    text = "".join(chr(0x2200 + i % 200) for i in range(400))  # math symbols: several tokens each
    counted = httpx.post(f"{serve_app['base_url']}/tokenize", json={"model": EMBED, "prompt": text},
                         headers=headers, timeout=60).json()["count"]
    copies = 300_000 // counted + 1
    assert copies <= 2048 and copies * len(text.encode()) // 4 < 300_000  # the router lets it through
    response = httpx.post(f"{serve_app['base_url']}/v1/embeddings", json={"model": EMBED, "input": [text] * copies},
                          headers=headers, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input" and "at most 300000" in error["message"]  # without the cap: a 200


def test_the_chat_model_does_not_embed_and_the_embedding_model_does_not_chat(user):
    client, _, _ = user
    with pytest.raises(openai.BadRequestError, match="does not serve /v1/embeddings"):
        client.embeddings.create(model="qwen-3.6-35b-a3b", input="x")
    with pytest.raises(openai.BadRequestError, match="does not serve /v1/chat/completions"):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_the_embedding_model_is_listed_loaded_with_its_task(user):
    client, _, _ = user
    card = client.models.retrieve(EMBED)
    assert (card.id, card.model_extra["task"], card.model_extra["state"]) == (EMBED, "embed", "loaded")
    assert EMBED in [m.id for m in client.models.list().data]


def test_an_embedding_is_recorded_once_with_the_engines_prompt_tokens(serve_app):
    keys = KeyStore(serve_app["auth"].key_store(), cache_ttl_s=0)
    key, record = keys.create_key(owner="it-embeddings-ledger", tier="standard")
    client = openai.OpenAI(base_url=f"{serve_app['base_url']}/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.embeddings.create(model=EMBED, input=["first text", "second text"], encoding_format="float")
    usage = UsageStore(open_database(serve_app["auth"].key_store()))
    deadline = time.monotonic() + WRITTEN_WITHIN_S
    while True:
        with usage.database.connect() as db:
            rows = [dict(r) for r in db.execute(
                "SELECT * FROM usage_records WHERE key_id = ?", (record.key_id,)
            ).fetchall()]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    (row,) = rows
    assert (row["model"], row["route"], row["status"], row["region"]) == (EMBED, "/v1/embeddings", 200, "local")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (reply.usage.prompt_tokens, 0)
