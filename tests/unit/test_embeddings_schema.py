"""The embeddings body, price and output shape, each against the other side's own definition:
OpenAI's ``CreateEmbeddingRequest`` and ``CreateEmbeddingResponse`` (vendored,
``tests/data/schemas/openai_embeddings.json``) and vLLM 0.32's ``EmbeddingCompletionRequest``."""

import json
import pathlib
from types import SimpleNamespace

import pytest
from jsonschema import Draft202012Validator
from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest

from serve_app.engine import openai_shape, outputs, pooling_timing
from serve_app.errors import APIError
from serve_app.router import pricing
from serve_app.router.embeddings_schema import MAX_INPUTS, MAX_REQUEST_TOKENS
from serve_app.router.request_schema import validate_body

MODEL = "qwen-3-embedding-0.6b"
SCHEMAS = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data/schemas/openai_embeddings.json").read_text())
OPENAI_REQUEST = Draft202012Validator({**SCHEMAS, "$ref": "#/components/CreateEmbeddingRequest"})

ACCEPTED = [
    {"input": "hello"},
    {"input": ["a", "b"]},
    {"input": [1, 2, 3]},
    {"input": [[1, 2], [3]]},
    {"input": ["x"] * MAX_INPUTS},
    {"input": "x", "encoding_format": "float"},
    {"input": "x", "encoding_format": "base64", "dimensions": 32, "user": "u-1"},
]
# What OpenAI's prose refuses and its JSON schema does not encode ("cannot be an empty
# string"; a token id is an index into the vocabulary): refused here too.
REFUSED_BY_THE_PROSE = [{"input": ""}, {"input": [""]}, {"input": ["a", ""]}, {"input": [-1]}, {"input": [[3, -1]]}]
# (body, param): what OpenAI's schema refuses, refused here with the field named.
REFUSED = [
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[1, "a"]]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
    ({}, "input"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "x", "encoding_format": None}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "32"}, "dimensions"),
    ({"input": "x", "user": 7}, "user"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"input": "x", "use_activation": False}, "use_activation"),
    ({"input": "x", "chat_template": "{{ messages }}"}, "chat_template"),
    ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_what_openai_accepts_is_accepted_and_vllm_takes_it_as_sent(body):
    full = {"model": MODEL, **body}
    OPENAI_REQUEST.validate(full)
    validate_body("embeddings", dict(full))
    request = EmbeddingCompletionRequest.model_validate(full)  # what the replica builds
    assert request.input == body["input"]
    assert request.encoding_format == body.get("encoding_format", "float")
    assert request.dimensions == body.get("dimensions")


@pytest.mark.parametrize("body, param", REFUSED)
def test_what_openai_refuses_is_a_400_naming_the_field(body, param):
    full = {"model": MODEL, **body}
    assert not OPENAI_REQUEST.is_valid(full)
    with pytest.raises(APIError) as refused:
        validate_body("embeddings", full)
    assert (refused.value.status, refused.value.param) == (400, param)


@pytest.mark.parametrize("body", REFUSED_BY_THE_PROSE)
def test_an_empty_string_or_a_negative_token_id_is_a_400_naming_input(body):
    with pytest.raises(APIError) as refused:
        validate_body("embeddings", {"model": MODEL, **body})
    assert (refused.value.status, refused.value.param) == (400, "input")


@pytest.mark.parametrize("field", ["cache_salt", "request_id"])
def test_the_fields_the_server_sets_are_refused(field):
    with pytest.raises(APIError) as refused:
        validate_body("embeddings", {"model": MODEL, "input": "x", field: "mine"})
    assert refused.value.param == field and "server" in refused.value.message


@pytest.mark.parametrize("value, told", [
    (["x"] * (MAX_INPUTS + 1), f"{MAX_INPUTS + 1} inputs; at most {MAX_INPUTS} in one request"),
    ([7] * (MAX_INPUTS + 1), f"{MAX_INPUTS + 1} token ids in one input; at most {MAX_INPUTS} in a list of token ids"),
])
def test_a_list_too_long_is_told_as_inputs_or_as_one_inputs_token_ids(value, told):
    """A list of token ids is one input: it was told "2049 inputs" (found by a review)."""
    with pytest.raises(APIError) as refused:
        validate_body("embeddings", {"model": MODEL, "input": value})
    assert told in refused.value.message and refused.value.param == "input"


def test_the_vllm_fields_kept_are_priority_lowered_and_truncation():
    validate_body("embeddings", {"model": MODEL, "input": "x", "priority": 5, "truncate_prompt_tokens": 512})
    for field, value in (("priority", -1), ("truncate_prompt_tokens", 0)):
        with pytest.raises(APIError) as refused:
            validate_body("embeddings", {"model": MODEL, "input": "x", field: value})
        assert refused.value.param == field


def test_more_token_ids_than_openais_request_cap_are_refused_before_the_engine():
    per_input = MAX_REQUEST_TOKENS // MAX_INPUTS + 1
    with pytest.raises(APIError) as refused:
        validate_body("embeddings", {"model": MODEL, "input": [[1] * per_input] * MAX_INPUTS})
    assert refused.value.param == "input" and f"{MAX_REQUEST_TOKENS}" in refused.value.message


def test_an_empty_entry_is_named_by_its_index():
    with pytest.raises(APIError) as refused:
        validate_body("embeddings", {"model": MODEL, "input": ["a", "b", ""]})
    assert "entry 2" in refused.value.message


# --- pricing: input tokens only ---------------------------------------------------------------
def _price(body, size=None):
    raw = json.dumps(body)
    return pricing.price("embeddings", body, size or len(raw), context_len=8192, default_max_tokens=None)


def test_embeddings_are_priced_by_their_input_alone():
    body = {"model": MODEL, "input": "word " * 100}
    price = _price(body)
    assert (price.completion_tokens, price.total) == (0, price.prompt_tokens)
    assert price.prompt_tokens == pricing.estimate_prompt_tokens(len(json.dumps(body)))
    assert body == {"model": MODEL, "input": "word " * 100}  # no limit field written


@pytest.mark.parametrize("value, ids", [([7] * 600, 600), ([[7] * 300, [8] * 500], 800), ("7 " * 600, 0)])
def test_token_id_inputs_are_priced_at_their_exact_count_when_the_size_says_less(value, ids):
    body = {"model": MODEL, "input": value}
    estimate = pricing.estimate_prompt_tokens(len(json.dumps(body)))
    assert _price(body).prompt_tokens == max(estimate, ids)
    if ids:
        assert ids > estimate  # "7," is two bytes a token: by size alone, half the price


# --- the output: OpenAI's response, exactly ---------------------------------------------------
VLLM_BODY = {
    "id": "embd-1", "object": "list", "created": 1, "model": MODEL,
    "data": [{"index": 0, "object": "embedding", "embedding": [0.6, 0.8]}],
    "usage": {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0, "prompt_tokens_details": None},
}


def test_vllms_body_becomes_openais_response_and_its_trailer_carries_the_input_tokens():
    body = json.loads(json.dumps(VLLM_BODY))
    summary = outputs.EMBEDDINGS.summarize(body)
    assert summary.usage == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    openai_shape.embeddings(body, {"model": MODEL})
    closed = {**SCHEMAS["components"]["CreateEmbeddingResponse"], "additionalProperties": False}
    Draft202012Validator({**SCHEMAS, **closed}).validate(body)
    assert body == {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
                    "model": MODEL, "usage": {"prompt_tokens": 3, "total_tokens": 3}}


def test_vllms_json_response_is_read_as_sent():
    from fastapi.responses import JSONResponse

    assert outputs.EMBEDDINGS.dump(JSONResponse(VLLM_BODY)) == VLLM_BODY


# --- engine timing of pooling requests ---------------------------------------------------------
def _stats(queued, scheduled, done):
    return SimpleNamespace(queued_ts=queued, scheduled_ts=scheduled, last_token_ts=done)


def test_a_requests_timing_spans_its_inputs_from_the_first_queued_to_the_last_done():
    timing = pooling_timing.timing([_stats(1.000, 1.002, 1.010), _stats(1.001, 1.004, 1.020)])
    assert timing.queue_ms == pytest.approx(2.0) and timing.prefill_ms == pytest.approx(18.0)
    assert timing.decode_ms is None
    unknown = pooling_timing.timing([_stats(0.0, 0.0, 0.0)])  # stats off: nothing invented
    assert (unknown.queue_ms, unknown.prefill_ms) == (None, None)


def test_only_requests_added_inside_collect_hand_over_their_stats():
    states = {}

    class Processor:
        request_states = states

        def add_request(self, request, prompt, *rest, **kwargs):
            states[request.request_id] = SimpleNamespace(stats=_stats(1.0, 1.5, 2.0))

    engine = SimpleNamespace(output_processor=Processor())
    pooling_timing.install(engine)
    engine.output_processor.add_request(SimpleNamespace(request_id="outside"), None)
    with pooling_timing.collect() as stats:
        engine.output_processor.add_request(SimpleNamespace(request_id="a"), None)
        engine.output_processor.add_request(SimpleNamespace(request_id="b"), None)
    assert stats == [states["a"].stats, states["b"].stats]
    engine.output_processor.add_request(SimpleNamespace(request_id="after"), None)
    assert len(stats) == 2


# --- the replica ---------------------------------------------------------------------------------
def test_a_replica_asked_for_a_surface_its_model_does_not_serve_answers_400_not_a_crash():
    """The router refuses it first (the model's task); the replica holds the same line, so a
    chat reaching an embedding model is a client error, never an AttributeError's 500."""
    import asyncio

    from serve_app.config import ModelDeploymentArgs
    from serve_app.engine.vllm_engine import VLLMEngine
    from serve_app.wire.messages import Call

    engine = VLLMEngine(ModelDeploymentArgs(id=MODEL), "/weights")
    engine._tasks = ("embed", "token_embed")  # what vLLM reports for a pooling model
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    answer = asyncio.run(engine.answer("chat", Call(body, "r1")))
    assert answer.status == 400 and answer.body["error"]["param"] == "model"
    assert "/v1/chat/completions" in answer.body["error"]["message"]
