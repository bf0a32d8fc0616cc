"""Router body handling and the context cap message, without Ray."""

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from serve_app.engine.rendered import overflow_message
from serve_app.errors import APIError
from serve_app.router import body as router_body
from serve_app.router.request_schema import parse_json_object


@pytest.fixture
def client():
    app = FastAPI()

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        from fastapi.responses import JSONResponse

        return JSONResponse(exc.body(), status_code=exc.status)

    @app.post("/echo")
    async def echo(request: Request):
        return parse_json_object(await router_body.read_body(request))

    return TestClient(app)


def test_json_object_passes(client):
    assert client.post("/echo", json={"model": "m"}).json() == {"model": "m"}


@pytest.mark.parametrize("raw", [b"nope", b"[1]", b'"text"', b"\xff"])
def test_non_object_bodies_are_400_invalid_json(client, raw):
    response = client.post("/echo", content=raw)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_body_over_the_limit_is_413_by_declared_length(client):
    response = client.post("/echo", content=b" " * (router_body.MAX_REQUEST_BODY_BYTES + 1))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(client):
    def chunks():
        for _ in range(router_body.MAX_REQUEST_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    response = client.post("/echo", content=chunks())
    assert response.status_code == 413


@pytest.mark.parametrize("encoding", ["gzip", "br", "identity, GZIP", "zstd, " + "x" * 300])
def test_a_compressed_body_is_415_never_inflated(client, encoding):
    """A gzip bomb of a few KiB would stand for gigabytes past the size limit; read as JSON it
    would be a misleading "invalid JSON"."""
    import gzip

    response = client.post("/echo", content=gzip.compress(b'{"model": "m"}'), headers={"content-encoding": encoding})
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["code"] == "unsupported_content_encoding" and "Content-Encoding" in error["message"]
    assert len(error["message"]) < 200  # the header's value is not echoed whole


@pytest.mark.parametrize("encoding", ["identity", "IDENTITY", "", "utf-8"])
def test_a_body_whose_coding_names_no_compression_is_read(client, encoding):
    """``utf-8``: some clients send it, meaning the charset; the body is plain JSON."""
    assert client.post("/echo", json={"model": "m"}, headers={"content-encoding": encoding}).json() == {"model": "m"}


def test_overflow_message_states_the_numbers():
    message = overflow_message(8192, 4016, 6000)
    assert "8192" in message and "10016" in message and "4016" in message and "6000" in message


def test_a_pooling_requests_tokens_are_capped_over_all_its_rendered_inputs():
    """``rendered.install_request_cap`` on a stand-in for vLLM's pooling serving object (the
    integration test runs the real one): over the cap, no engine request starts."""
    import asyncio
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from serve_app.engine import rendered

    class Serving:
        started = 0

        async def _prepare_generators(self, ctx):
            self.started += len(ctx.engine_inputs)

    def inputs(*lengths):
        return SimpleNamespace(engine_inputs=[{"prompts": {"prompt_token_ids": [7] * n}} for n in lengths])

    serving = Serving()
    rendered.install_request_cap(serving, 10)
    asyncio.run(serving._prepare_generators(inputs(4, 6)))  # 10: at the cap
    with pytest.raises(VLLMValidationError) as refused:
        asyncio.run(serving._prepare_generators(inputs(4, 4, 3)))
    assert refused.value.parameter == "input" and "11 tokens" in str(refused.value)
    assert serving.started == 2
    # As the replica answers it (vLLM's error response of the exception): its own code, which
    # keeps the inputs' estimate charged as the router settles (test_ratelimit_refunds.py).
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    from serve_app.engine import vllm_errors

    answer = vllm_errors.error_answer(create_error_response(refused.value), refused.value, body={"input": ["x"]})
    error = answer.body["error"]
    assert (answer.status, error["param"], error["code"]) == (400, "input", rendered.MAX_TOKENS_PER_REQUEST)
    assert error["message"] == "the input is 11 tokens, all its entries together; at most 10 in one request"
