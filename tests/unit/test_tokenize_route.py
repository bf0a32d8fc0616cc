"""``/tokenize`` and ``/detokenize`` at the router, without Ray: a fake router and model handle.

What runs is the real ``serve_app.router.tokenization.relay`` (auth order, validation, alias,
model scope, the one-token rate-limit charge, model state, the handle call and the JSON answer)
and the real router schemas; only the parts that need Ray or an engine are fakes.
"""

import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from serve_app.engine import tokenization as replica_rules
from serve_app.errors import APIError, retry_later
from serve_app.router import ingress, openapi, tokenization

MODEL = "qwen-3.6-35b-a3b"
ALIASES = {MODEL: MODEL, "qwen-3.6-a3b": MODEL}
TOKENIZED = {"count": 2, "max_model_len": 8192, "tokens": [9707, 1879]}


class FakeStream:
    def __init__(self, head):
        self.head = head

    async def __anext__(self):
        return self.head


class FakeHandle:
    def __init__(self, head):
        self.head, self.calls = head, []

    def __getattr__(self, method):
        handle = self

        class Remote:
            @staticmethod
            def remote(body):
                handle.calls.append((method, dict(body)))
                return FakeStream(handle.head)

        return Remote


class FakeAuth:
    def __init__(self, allowed=(MODEL,)):
        self.allowed, self.charged = allowed, []

    def authorize_model(self, caller, model_id):
        if model_id not in self.allowed:
            raise APIError(403, "not yours", param="model", code="model_not_allowed")

    async def admit(self, caller, tokens):
        self.charged.append(tokens)
        return {"x-ratelimit-remaining-requests": "59"}


class FakeStates:
    def __init__(self, serving=True):
        self.serving = serving

    async def ensure_fresh(self):
        pass

    def require_serving(self, model_id, region):
        if not self.serving:
            raise retry_later(f"{model_id} is cold in {region}", "model_cold", 60, param="model")


class FakeInFlight:
    def __init__(self):
        self.open = 0

    def begin(self, model_id):
        self.open += 1

        def release():
            self.open -= 1

        return release


class FakeRouter:
    region, replica = "local", "router-1"

    def __init__(self, head=None, *, authenticated=True, **fakes):
        self.head = head or {"status": 200, "body": dict(TOKENIZED), "stream": False, "trailer": {"replica": "r1"}}
        self.handle = FakeHandle(self.head)
        self.streaming = {MODEL: self.handle}
        self.auth = fakes.get("auth", FakeAuth())
        self.states = fakes.get("states", FakeStates())
        self.in_flight = FakeInFlight()
        self.authenticated = authenticated
        self.bodies_read = 0

    async def _caller(self, request):
        if not self.authenticated:
            raise APIError(401, "no credential", code="missing_authorization")
        return object()

    def _resolve(self, name):
        if name not in ALIASES:
            raise APIError(404, f"no model {name!r}", param="model", code="model_not_found")
        return ALIASES[name]


def client_for(router: FakeRouter) -> TestClient:
    app = FastAPI()

    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def read_body(request: Request) -> bytes:
        router.bodies_read += 1
        return await ingress._read_body_within_limit(request)

    @app.post("/{method}")
    async def route(method: str, request: Request):
        return await tokenization.relay(router, request, method, read_body)

    return TestClient(app)


def test_tokenize_resolves_the_alias_charges_one_token_and_answers_the_replicas_body():
    router = FakeRouter()
    response = client_for(router).post("/tokenize", json={"model": "qwen-3.6-a3b", "prompt": "Hello world"})
    assert response.status_code == 200
    body = response.json()
    assert {key: body[key] for key in TOKENIZED} == TOKENIZED
    assert body["pg_metadata"]["model"] == MODEL
    assert "total;dur=" in response.headers["server-timing"] and response.headers["x-pg-region"] == "local"
    assert router.handle.calls == [("tokenize", {"model": MODEL, "prompt": "Hello world"})]
    assert router.auth.charged == [tokenization.TOKENIZE_TOKEN_COST] == [1]  # not prompt + max_tokens
    assert router.in_flight.open == 0  # the slot is given back


def test_detokenize_goes_to_the_replicas_detokenize():
    head = {"status": 200, "body": {"prompt": "Hello world"}, "stream": False, "trailer": {}}
    router = FakeRouter(head)
    response = client_for(router).post("/detokenize", json={"model": MODEL, "tokens": [9707, 1879]})
    assert response.status_code == 200 and response.json()["prompt"] == "Hello world"
    assert router.handle.calls[0][0] == "detokenize"


@pytest.mark.parametrize(
    "method, body, param",
    [
        ("tokenize", {"model": MODEL}, None),
        ("tokenize", {"model": MODEL, "prompt": 42}, "prompt"),
        ("tokenize", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ("tokenize", {"model": MODEL, "prompt": "x", "add_generation_prompt": True}, None),
        ("tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("detokenize", {"model": MODEL, "tokens": [1, -2]}, "tokens[1]"),
        ("detokenize", {"model": MODEL, "tokens": [1, True]}, "tokens[1]"),
        ("detokenize", {"model": MODEL, "tokens": "1 2"}, "tokens"),
        ("detokenize", {"model": MODEL}, "tokens"),
    ],
)
def test_bad_bodies_are_400_before_anything_is_charged_or_sent(method, body, param):
    router = FakeRouter()
    response = client_for(router).post(f"/{method}", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert router.auth.charged == [] and router.handle.calls == []


def test_no_credential_is_401_before_the_body_is_read():
    router = FakeRouter(authenticated=False)
    response = client_for(router).post("/tokenize", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 401 and router.bodies_read == 0


def test_unknown_model_is_404_and_a_model_outside_the_keys_scope_is_403():
    router = FakeRouter()
    assert client_for(router).post("/tokenize", json={"model": "gpt-5", "prompt": "x"}).status_code == 404
    router = FakeRouter(auth=FakeAuth(allowed=()))
    response = client_for(router).post("/tokenize", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 403 and router.auth.charged == []


def test_a_model_not_loaded_here_is_503_with_retry_after():
    router = FakeRouter(states=FakeStates(serving=False))
    response = client_for(router).post("/tokenize", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 503 and response.headers["retry-after"] == "60"
    assert router.handle.calls == []


def test_the_replicas_error_is_answered_with_its_status():
    error = {"error": {"message": "token id 999999 is not in the model's vocabulary", "type": "invalid_request_error",
                       "param": "tokens[0]", "code": None}}
    router = FakeRouter({"status": 400, "body": error, "stream": False})
    response = client_for(router).post("/detokenize", json={"model": MODEL, "tokens": [999999]})
    assert response.status_code == 400 and response.json() == error


def test_the_replica_refuses_ids_past_the_tokenizer_by_index():
    assert replica_rules.first_unknown_token([], 10) is None
    assert replica_rules.first_unknown_token([0, 9], 10) is None
    assert replica_rules.first_unknown_token([3, 10, 12], 10) == 1
    assert "ids 0 to 9" in replica_rules.unknown_token_message(10, 10)


def test_the_replica_never_streams_a_tokenization():
    body = {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    replica_rules.never_stream(body)
    assert body == {"model": MODEL, "prompt": "x"}


def test_openapi_publishes_both_bodies_with_the_inference_errors():
    schema = openapi.build(ingress.app)
    for path, model in (("/tokenize", "TokenizeBody"), ("/detokenize", "DetokenizeBody")):
        operation = schema["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"400", "401", "403", "404", "413", "429", "503"} <= set(operation["responses"])
        assert "422" not in operation["responses"]
    assert "messages" in schema["components"]["schemas"]["TokenizeBody"]["properties"]


def test_the_router_side_never_imports_vllm():
    code = "import sys, serve_app.router.ingress, serve_app.router.tokenization; print('vllm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
