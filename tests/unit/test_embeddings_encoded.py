"""An embeddings answer as JSON text (``outputs.encoded_embeddings``, ``Answer.encoded``): vLLM's
rendering of its own response, its vectors never decoded, is exactly the body the decoded path
makes (``openai_shape.embeddings``); the router adds ``pg_metadata`` to the text
(``relay.with_member``); and a router released before takes the dict, as it always did."""

import base64
import json
import pickle
import struct

import pytest

from serve_app.engine import openai_shape, outputs
from serve_app.router.relay import with_member
from serve_app.wire.messages import Answer, Call
from tests.unit.test_wire_messages import _as_written_by

protocol = pytest.importorskip("vllm.entrypoints.pooling.embed.protocol")
from vllm.entrypoints.pooling.utils import get_json_response_cls  # noqa: E402
from vllm.entrypoints.serve.engine.protocol import UsageInfo  # noqa: E402

REQUEST = {"model": "qwen-3-embedding-0.6b", "input": ["a", "b", "c"]}


def vllm_rendered(embeddings, prompt_tokens: int = 7) -> bytes:
    """The body vLLM's embed serving answers (``_openai_json_response``): its response model,
    dumped, in the JSON response class it picks (orjson's when installed)."""
    data = [protocol.EmbeddingResponseData(index=i, embedding=e) for i, e in enumerate(embeddings)]
    response = protocol.EmbeddingResponse(id="embd-1", created=1, model="Qwen/Qwen3-Embedding-0.6B", data=data,
                                          usage=UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))
    return bytes(get_json_response_cls()(content=response.model_dump()).body)


FLOATS = [[0.1, -2.5e-07, 3.0], [1e-30, 0.0, -0.333333333333], [7.0, 8.5, -9.25]]
BASE64 = [base64.b64encode(struct.pack("<3f", *vector)).decode() for vector in FLOATS]


@pytest.mark.parametrize("embeddings", [FLOATS, BASE64, [[0.5] * 1024] * 64], ids=["float", "base64", "64x1024"])
def test_the_encoded_answer_is_the_decoded_answers_body_exactly(embeddings):
    raw = vllm_rendered(embeddings)
    encoded = outputs.EmbeddingsOutput(encoded=True).answer(_Result(raw), dict(REQUEST))
    decoded = outputs.EmbeddingsOutput().answer(_Result(raw), dict(REQUEST))
    assert encoded.body == {} and decoded.encoded is None
    assert json.loads(encoded.encoded) == decoded.body == openai_shape.embeddings(json.loads(raw), REQUEST)
    assert list(json.loads(encoded.encoded)) == ["object", "data", "model", "usage"]  # OpenAI's order
    assert encoded.trailer == decoded.trailer and encoded.trailer.usage["prompt_tokens"] == 7


@pytest.mark.parametrize("raw", [b'{"data":[1]}', b'{"usage":{},"data":[[1]]}', b"not json", b'{"data":[],"usage":x}'])
def test_a_body_laid_out_otherwise_is_decoded(raw):
    assert outputs.encoded_embeddings(raw, "m") is None


def test_the_router_adds_its_metadata_to_the_text_as_the_last_member():
    body = {"object": "list", "data": [{"index": 0, "embedding": [1.5]}], "model": "m"}
    merged = with_member(json.dumps(body, separators=(",", ":")).encode(), "pg_metadata", {"region": "yul-02"})
    assert json.loads(merged) == {**body, "pg_metadata": {"region": "yul-02"}}


def test_a_replica_answers_a_router_released_before_with_the_dict():
    """Rolling upgrade: an older router's Call has no ``encoded_answers`` (it reads as False) and
    would drop an Answer's ``encoded`` it does not know: the replica answers it the dict."""
    # As a router released before writes it: the eight fields it had.
    older_call = pickle.loads(_as_written_by(Call({"model": "m"}, "r1"), [{"model": "m"}, "r1", False] + [None] * 5))
    assert older_call.encoded_answers is False
    answer = outputs.EmbeddingsOutput(encoded=older_call.encoded_answers).answer(_Result(vllm_rendered(FLOATS)),
                                                                                 dict(REQUEST))
    assert answer.encoded is None and answer.body["data"][0]["embedding"] == FLOATS[0]
    assert pickle.loads(pickle.dumps(Answer(200, {}, encoded=b"{}"))).encoded == b"{}"


class _Result:
    def __init__(self, body: bytes):
        self.body = body
