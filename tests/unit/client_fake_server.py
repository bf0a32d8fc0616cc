"""Fake regions for the client's unit tests: small Starlette apps served by uvicorn on 127.0.0.1.

A real HTTP server rather than ``httpx.MockTransport``: streams, read timeouts, connection reuse
and a connection cut mid-stream only behave as they do against the real router over a socket.

Each ``FakeRegion`` answers like the router (docs/api.md, docs/auth.md): ``POST /v1/auth/token``
mints opaque tokens that it expires on its own clock; inference routes check the Bearer value
(401 ``token_expired`` / ``invalid_api_key``), then play the next scripted answer or a default
success (JSON with ``pg_metadata`` + ``Server-Timing``, or an SSE stream ending as the router ends
it: chat's ``pg_metadata`` event and ``[DONE]``; Responses' terminal event with
``response.pg_metadata``; Messages' ``message_stop`` with ``pg_metadata``), always with
``x-pg-region``. Responses it answered are kept for ``GET``/``DELETE /v1/responses/{id}``.
"""

import asyncio
import base64
import json
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


MODEL = "qwen-3.6-35b-a3b"
SERVER_TIMING = "network;dur=1.500, queue;dur=0.250, inference;dur=20.000, total;dur=21.750"


def error(status: int, message: str, *, type_: str, code: str | None = None, param: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def unavailable(retry_after: str | None = "1", code: str = "overloaded") -> JSONResponse:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return error(503, "busy; retry shortly", type_="service_unavailable", code=code, headers=headers)


def sse(payload: Any, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return ((f"event: {event}\n" if event else "") + f"data: {data}\n\n").encode()


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None

    @property
    def bearer(self) -> str | None:
        value = self.headers.get("authorization", "")
        return value.removeprefix("Bearer ") if value.startswith("Bearer ") else None

    @property
    def trace_id(self) -> str:
        return self.headers["traceparent"].split("-")[1]


@dataclass
class FakeRegion:
    name: str
    api_key: str = field(default_factory=lambda: f"pgk_0123456789ab_{secrets.token_urlsafe(32)}")
    token_ttl_s: int = 900  # what the token endpoint says (expires_in)
    server_ttl_s: float | None = None  # when the server really expires a token (default: token_ttl_s)
    exchange: bool = True  # False: the token route does not exist (404), as on a bare vLLM
    accept_api_key: bool = True  # the router accepts a raw key as the Bearer value
    answers: list[Callable[[Seen], Response] | Response] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    tokens: dict[str, float] = field(default_factory=dict)  # token -> expiry (server clock)
    statuses: list[int] = field(default_factory=list)  # every status it answered inference with
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)  # responses by id, as stored
    token_answers: list[Response] = field(default_factory=list)  # the token route's next answers, then mints
    refused: set[str] = field(default_factory=set)  # tokens refused as invalid_token (``refuse_tokens``)

    def expire_tokens(self) -> None:
        """Expire every token minted so far, on the server's side only (the client is not told)."""
        for token in self.tokens:
            self.tokens[token] = 0.0

    def refuse_tokens(self) -> None:
        """Refuse every token minted so far as ``invalid_token`` (their signing key rotated out)."""
        self.refused.update(self.tokens)

    def inference(self) -> list[Seen]:
        return [s for s in self.seen if s.path != "/v1/auth/token"]

    def exchanges(self) -> list[Seen]:
        return [s for s in self.seen if s.path == "/v1/auth/token"]

    # --- routes ------------------------------------------------------------------------------
    async def _token(self, request: Request) -> Response:
        seen = await self._record(request)
        if not self.exchange:
            return await _not_found(request, None)
        if self.token_answers:
            return self.token_answers.pop(0)
        if ((seen.body or {}).get("api_key") or seen.bearer) != self.api_key:  # the router takes either
            return error(401, "Incorrect API key provided", type_="authentication_error", code="invalid_api_key")
        token = f"tok-{self.name}-{len(self.tokens) + 1}-{secrets.token_hex(8)}"
        ttl = self.server_ttl_s if self.server_ttl_s is not None else self.token_ttl_s
        self.tokens[token] = time.monotonic() + ttl
        return JSONResponse({"access_token": token, "token_type": "Bearer", "expires_in": self.token_ttl_s,
                             "scope": "inference"})

    async def _inference(self, request: Request) -> Response:
        seen = await self._record(request)
        refusal = self._refusal(seen.bearer)
        if refusal is not None and seen.path.startswith("/v1/messages"):
            refusal = _anthropic_401(refusal)
        answer = refusal or (self.answers.pop(0) if self.answers else self._success)
        response = answer if isinstance(answer, Response) else answer(seen)
        self.statuses.append(response.status_code)
        response.headers.setdefault("x-pg-region", self.name)
        return response

    def _refusal(self, credential: str | None) -> Response | None:
        if credential in self.refused:
            return error(401, "token signature is invalid", type_="authentication_error", code="invalid_token")
        if credential in self.tokens:
            if time.monotonic() < self.tokens[credential]:
                return None
            return error(401, "token has expired; mint a new one", type_="authentication_error", code="token_expired")
        if credential == self.api_key and self.accept_api_key:
            return None
        return error(401, "Incorrect API key provided", type_="authentication_error", code="invalid_api_key")

    def _success(self, seen: Seen) -> Response:
        if seen.path == "/v1/responses":
            return self._responses_success(seen)
        if seen.path.startswith("/v1/messages"):
            return self._messages_success(seen)
        if seen.path == "/v1/embeddings":
            return JSONResponse(self.embeddings(seen), headers={"Server-Timing": SERVER_TIMING})
        chat = seen.path == "/v1/chat/completions"
        if (seen.body or {}).get("stream"):
            return StreamingResponse(_iterate(self.stream_events(seen)), media_type="text/event-stream")
        choice = {"index": 0, "finish_reason": "stop"} | (
            {"message": {"role": "assistant", "content": "Hi there."}} if chat else {"text": "Hi there."}
        )
        body = {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "created": 1,
                "model": MODEL, "choices": [choice],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
                "pg_metadata": self.metadata(seen)}
        return JSONResponse(body, headers={"Server-Timing": SERVER_TIMING})

    def _responses_success(self, seen: Seen) -> Response:
        if (seen.body or {}).get("stream"):
            return StreamingResponse(_iterate(self.responses_events(seen)), media_type="text/event-stream")
        body = self.response_object(seen, "completed")
        self.stored[body["id"]] = dict(body)
        return JSONResponse({**body, "pg_metadata": self.metadata(seen)}, headers={"Server-Timing": SERVER_TIMING})

    def _messages_success(self, seen: Seen) -> Response:
        if seen.path == "/v1/messages/count_tokens":
            return JSONResponse({"input_tokens": 9, "pg_metadata": self.metadata(seen)},
                                headers={"Server-Timing": SERVER_TIMING})
        if (seen.body or {}).get("stream"):
            return StreamingResponse(_iterate(self.messages_events(seen)), media_type="text/event-stream")
        body = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                "content": [{"type": "text", "text": "Hi there.", "citations": None}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 3},
                "pg_metadata": self.metadata(seen)}
        return JSONResponse(body, headers={"Server-Timing": SERVER_TIMING})

    def response_object(self, seen: Seen, status: str, text: str = "Hi there.") -> dict[str, Any]:
        done = status != "in_progress"
        message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
        return {"id": f"resp_{len(self.stored) + 1}", "object": "response", "status": status, "model": MODEL,
                "created_at": 1, "output": [message] if done else [],
                "usage": {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8} if done else None,
                "previous_response_id": (seen.body or {}).get("previous_response_id"),
                "safety_identifier": None, "prompt_cache_key": None}

    def responses_events(self, seen: Seen, *, pieces=("Hi", " there", "."), status="completed") -> list[bytes]:
        """A Responses stream as the router sends it: created, in_progress, the deltas, then the
        terminal event with the timing in its response; numbered from 0."""
        started = self.response_object(seen, "in_progress")
        events = [{"type": "response.created", "response": started}, {"type": "response.in_progress", "response": started}]
        events += [{"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0,
                    "delta": piece, "logprobs": []} for piece in pieces]
        final = self.response_object(seen, status, "".join(pieces))
        self.stored[final["id"]] = dict(final)
        events.append({"type": f"response.{status}", "response": {**final, "pg_metadata": self.metadata(seen)}})
        return [sse({**event, "sequence_number": n}, event=event["type"]) for n, event in enumerate(events)]

    def messages_events(self, seen: Seen, *, pieces=("Hi", " there", ".")) -> list[bytes]:
        """A Messages stream as the router sends it, ``message_stop`` last with the timing."""
        start = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 0}}
        events = [{"type": "message_start", "message": start},
                  {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  {"type": "ping"}]
        events += [{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
                   for piece in pieces]
        events += [{"type": "content_block_stop", "index": 0},
                   {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": 3}},
                   {"type": "message_stop", "pg_metadata": self.metadata(seen)}]
        return [sse(event, event=event["type"]) for event in events]

    async def _stored(self, request: Request) -> Response:
        seen = await self._record(request)
        refusal = self._refusal(seen.bearer)
        if refusal is not None and seen.path.startswith("/v1/messages"):
            refusal = _anthropic_401(refusal)
        if refusal is not None:
            return refusal
        response_id = request.path_params["response_id"]
        if response_id not in self.stored:
            return error(404, f"no response {response_id}", type_="invalid_request_error", param="response_id")
        if request.method == "DELETE":
            del self.stored[response_id]
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        return JSONResponse(self.stored[response_id])
    def embeddings(self, seen: Seen) -> dict[str, Any]:
        """The router's embeddings body: one vector per input, [0.5, -0.25, 1.0 + index], float
        or base64 little-endian float32 as asked."""
        body = seen.body or {}
        inputs = body["input"] if isinstance(body.get("input"), list) else [body.get("input")]
        data = []
        for index, _ in enumerate(inputs):
            vector = [0.5, -0.25, 1.0 + index]
            if body.get("encoding_format") == "base64":
                vector = base64.b64encode(struct.pack("<3f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        return {"object": "list", "data": data, "model": body.get("model"),
                "usage": {"prompt_tokens": 4, "total_tokens": 4}, "pg_metadata": self.metadata(seen)}

    def metadata(self, seen: Seen) -> dict[str, Any]:
        return {"inference_ttft_ms": 12.5, "inference_total_ms": 20.0, "queue_ms": 0.25, "network_ms": 1.5,
                "server_ms": 21.75, "region": self.name, "replica": "model-1", "router_replica": "router-1",
                "model": MODEL, "alias": (seen.body or {}).get("model"), "trace_id": seen.trace_id}

    def stream_events(self, seen: Seen, *, pieces=("Hi", " there", ".")) -> list[bytes]:
        """A chat stream as the router sends it: role, content pieces, finish, pg_metadata, [DONE]."""
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        events = [sse(chunk({"role": "assistant", "content": ""}))]
        events += [sse(chunk({"content": piece})) for piece in pieces]
        events.append(sse(chunk({}, "stop")))
        events.append(sse(chunk({}) | {"pg_metadata": self.metadata(seen)}, event="pg_metadata"))
        events.append(sse("[DONE]"))
        return events

    async def _models(self, request: Request) -> Response:
        seen = await self._record(request)
        refusal = self._refusal(seen.bearer)
        if refusal is not None and seen.path.startswith("/v1/messages"):
            refusal = _anthropic_401(refusal)
        return refusal or JSONResponse({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 1, "owned_by": "serve_app", "state": "loaded",
             "region": self.name, "aliases": ["qwen-3.6-a3b"]}]})

    async def _record(self, request: Request) -> Seen:
        raw = await request.body()
        seen = Seen(request.url.path, dict(request.headers), json.loads(raw) if raw else None)
        self.seen.append(seen)
        return seen

    def app(self) -> Starlette:
        routes = [
            Route("/v1/auth/token", self._token, methods=["POST"]),
            Route("/v1/chat/completions", self._inference, methods=["POST"]),
            Route("/v1/completions", self._inference, methods=["POST"]),
            Route("/v1/responses", self._inference, methods=["POST"]),
            Route("/v1/responses/{response_id}", self._stored, methods=["GET", "DELETE"]),
            Route("/v1/messages", self._inference, methods=["POST"]),
            Route("/v1/messages/count_tokens", self._inference, methods=["POST"]),
            Route("/v1/embeddings", self._inference, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={404: _not_found})


async def _not_found(request: Request, exc: Exception | None) -> Response:
    """What FastAPI answers the real router for a route it does not have (code ``not_found``)."""
    return error(404, "Not Found", type_="invalid_request_error", code="not_found")


def _anthropic_401(refusal: JSONResponse) -> JSONResponse:
    """The router's 401 on Anthropic's routes: Anthropic's error shape (no ``code``), with RFC
    6750's challenge saying why (``principal.unauthorized``)."""
    message = json.loads(refusal.body)["error"]["message"]
    challenge = f'Bearer realm="serve_app", error="invalid_token", error_description="{message}"'
    return JSONResponse({"type": "error", "error": {"type": "authentication_error", "message": message}},
                        status_code=401, headers={"WWW-Authenticate": challenge})


async def _iterate(events: list[bytes], delay_s: float = 0.0):
    for event in events:
        if delay_s:
            await asyncio.sleep(delay_s)
        yield event


def streaming(events: list[bytes], *, delay_s: float = 0.0, then: Callable[[], None] | None = None) -> Response:
    """A 200 stream of ``events``; ``then`` runs after the last one (e.g. raise, to cut the connection)."""
    async def body():
        async for event in _iterate(events, delay_s):
            yield event
        if then is not None:
            then()
    return StreamingResponse(body(), media_type="text/event-stream")


@contextmanager
def serving(*regions: FakeRegion) -> Iterator[list[str]]:
    """Run each region on its own free 127.0.0.1 port; yields their base URLs; stops them after."""
    servers, threads, urls = [], [], []
    for region in regions:
        sock = socket.socket()  # bound here, so no other process can take the port before uvicorn listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(region.app(), host="127.0.0.1", port=port, log_level="critical", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append(server), threads.append(thread), urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 10
    while not all(s.started for s in servers):
        if time.monotonic() > deadline:
            raise RuntimeError("fake region did not start")
        time.sleep(0.01)
    try:
        yield urls
    finally:
        for server in servers:
            server.should_exit = True
        for thread in threads:
            thread.join(timeout=10)


def run_client(region: FakeRegion, scenario, *, regions=(), **options):
    """Serve ``region`` (and ``regions``), create a client against all of them, run ``scenario``."""
    from serve_app.client import AsyncClient

    with serving(region, *regions) as urls:
        async def go():
            async with await AsyncClient.create(region.api_key, base_urls=urls, **options) as client:
                return await scenario(client)

        return asyncio.run(go())


_UNLISTENED: list[socket.socket] = []


def dead_url() -> str:
    """A 127.0.0.1 URL nothing listens on: connecting is refused at once. Its port stays bound
    (never listening) for the rest of the session, so no other process can start answering there."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _UNLISTENED.append(sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"
