"""The router deployment: the FastAPI ingress every request enters through.

Request path, top to bottom: Serve proxy → ``Router`` (authenticate, read body, resolve alias,
check the caller's model scope and rate limit, check the model is loaded here, pick the model's
handle: ``inference.py``) → ``ModelServer`` over a streaming handle → vLLM. The router never imports vLLM; it relays
the replica's head (status + body) and, for streams, the replica's SSE events unchanged. When this
region cannot serve the request (the model is overloaded, not loaded, or its replica died), the
router forwards it once to a peer region (``serve_app.router.failover``). Auth lives in
``serve_app.auth``; hot-load states in ``serve_app.hot_load.state``.
"""

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import catalog
from serve_app.auth.authenticator import Authenticator, registry_unavailable
from serve_app.auth.database import RegistryUnavailable
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE
from serve_app.auth.lease import LeasedRateLimiter
from serve_app.auth.principal import Principal
from serve_app.auth.ratelimit import SharedRateLimiter
from serve_app.config import AppArgs
from serve_app.errors import APIError, error_body
from serve_app.hot_load.state import COLD, LOADED, RECOVERING
from serve_app.router import inference, metering, openapi, relay, tokenization
from serve_app.router.failover import Forwarder, is_forwarded
from serve_app.router.metering import Meter
from serve_app.hot_load.tracker import InFlight, ModelStates
from serve_app.router.relay import Exchange
from serve_app.router.request_schema import describe_validation_errors, parse_json_object
from serve_app.router.response_store import ResponseStore
from serve_app.router.responses import ResponsesAPI
from serve_app.telemetry.metrics import setup_metrics
from serve_app.usage.store import UsageStore
from serve_app.telemetry.tracing import setup_tracing
from serve_app.telemetry.logs import module_logger

logger = module_logger(__name__)

# A full 8192-token prompt is ~32 KiB of text; tools and schemas add some. Anything near this is
# abuse or a client bug, and reading it would cost router memory for nothing.
MAX_REQUEST_BODY_BYTES = 2 * 1024 * 1024
# /health re-reads Serve's status when its view is older than this (probes come every few seconds).
HEALTH_STATUS_MAX_AGE_S = 2.0
# ...but never waits longer than this for it: a slow controller makes the answer older, not late.
HEALTH_WAIT_S = 0.25

app = FastAPI(title="serve_app", docs_url=None, redoc_url=None)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


openapi.install(app)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    # A 405 carries Starlette's Allow header: the methods the path does take.
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code, headers=exc.headers
    )


@app.exception_handler(RegistryUnavailable)
async def _registry_unavailable(_: Request, exc: RegistryUnavailable) -> JSONResponse:
    """Wherever the key registry was needed (token endpoint, admin routes): 503, not 500."""
    return await _api_error(_, registry_unavailable(exc))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    error = describe_validation_errors(exc.errors())
    return JSONResponse(error.body(), status_code=400)


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in router")
    return JSONResponse(error_body(500, "internal error; it has been logged"), status_code=500)


# Helpers stand above the class: serve.ingress pickles the FastAPI app when the class is
# decorated, so names defined below it would be missing in the replica.
async def _read_json_object(request: Request) -> dict[str, Any]:
    return parse_json_object(await _read_body_within_limit(request))


async def _read_body_within_limit(request: Request) -> bytes:
    """The body, refusing (413) before buffering more than MAX_REQUEST_BODY_BYTES."""
    too_large = APIError(
        413,
        f"request body exceeds {MAX_REQUEST_BODY_BYTES} bytes",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BODY_BYTES:
        raise too_large
    received = bytearray()
    async for chunk in request.stream():  # chunked uploads carry no content-length
        received += chunk
        if len(received) > MAX_REQUEST_BODY_BYTES:
            raise too_large
    return bytes(received)


async def _api_key_in_body(request: Request) -> str | None:
    """``POST /v1/auth/token`` takes ``{"api_key": ...}``; without one, the Bearer value is the key."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return None
    api_key = (await _read_json_object(request)).get("api_key")
    if api_key is not None and not isinstance(api_key, str):
        raise APIError(400, "api_key must be a string", param="api_key", code="invalid_api_key_field")
    return api_key or None


async def _model_in_body(request: Request) -> Any:
    """``POST /v1/models/load`` and ``/unload`` take ``{"model": <id, alias or HF repo id>}``."""
    return (await _read_json_object(request)).get("model")


@serve.deployment
@serve.ingress(app)
class Router:
    async def __init__(self, models: dict[str, DeploymentHandle], args: AppArgs):
        self.models = models
        # Inference calls stream (head, then trailer); made once here, not per request.
        self.streaming = {model_id: handle.options(stream=True) for model_id, handle in models.items()}
        self.region = region = args.region
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.created = int(time.time())
        # This process owns the global tracer provider (docs/operations.md, "Tracing").
        setup_tracing(args.telemetry, region=region, deployment="Router", replica=self.replica)
        setup_metrics(args.telemetry)
        # Rate limits live in one actor per region, shared by every router replica. Look it up
        # (or start it) now: its worker process takes ~1 s to start, which the first request
        # would otherwise wait for, or be admitted unlimited when the limiter's 2 s timeout hits.
        limiter = SharedRateLimiter(region)
        limiter.actor()
        # Admission from a lease of the actor's budget: no actor call on the common path.
        self.auth = Authenticator(args.auth, region, LeasedRateLimiter(limiter))
        self.states = ModelStates(context.app_name, args.models)
        self.in_flight = InFlight(args.models)
        self.max_model_len = {
            model.id: model.engine.max_model_len or catalog.get(model.id).engine.max_model_len for model in args.models
        }
        self.responses = ResponsesAPI(
            ResponseStore(
                args.response_store_path(),
                retention_s=args.responses.retention_hours * 3600,
                max_responses=args.responses.max_responses,
            )
        )
        # Usage records go to the key registry's database (one ledger for every region).
        self.meter = Meter(
            UsageStore(self.auth.keys.database),
            args.usage_spool_dir(),
            region=region,
            writer_id=self.replica,
            cache_ttl_s=args.auth.cache_ttl_s,
            flush_interval_s=args.usage.flush_interval_s,
        )
        self.meter.start()
        failover = args.failover
        self.forwarder = Forwarder(
            region,
            failover.peers,
            connect_timeout_s=failover.connect_timeout_s,
            read_timeout_s=failover.read_timeout_s,
            max_attempts=failover.max_attempts,
            unreachable_hold_s=failover.unreachable_hold_s,
        )

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica: end the state refresh, write the usage
        records still pending (or spool them), close peer connections."""
        self.states.stop()
        await relay.wait_settled()  # abandoned streams' trailers: their records, then the last write
        await self.meter.aclose()
        await self.forwarder.aclose()

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """Liveness and readiness for the load balancer and the global DNS health check.

        Read from Serve's own view of its replicas — which its health checks keep — and this
        router's count of in-flight requests, never through a model's request slots, so it
        answers at once however busy the region is. 200 while a loaded model has a running
        replica: ``status`` is ``ok``, or ``busy`` when every serving model's slots are taken
        (requests queue or are shed, but the region serves). 503 when no model serves:
        ``recovering`` while Serve replaces a failed replica, else ``unavailable``.
        """
        await self.states.ensure_fresh(max_status_age_s=HEALTH_STATUS_MAX_AGE_S, wait_s=HEALTH_WAIT_S)
        states = {model_id: self.states.get(model_id) for model_id in self.models}
        load = {model_id: self.in_flight.load(model_id, state.running) for model_id, state in states.items()}
        serving = [model_id for model_id, state in states.items() if state.serving]
        if serving:
            status = "busy" if all(load[model_id]["busy"] for model_id in serving) else "ok"
        else:
            status = "recovering" if any(s.state == RECOVERING for s in states.values()) else "unavailable"
        return JSONResponse(
            {
                "status": status,
                "region": self.region,
                "models": {model_id: state.serving for model_id, state in states.items()},
                "states": {model_id: state.state for model_id, state in states.items()},
                "load": load,
            },
            status_code=200 if serving else 503,
        )

    @app.get("/.well-known/jwks.json")
    async def jwks(self) -> JSONResponse:
        """Public by design: the keys any region verifies our tokens with."""
        return JSONResponse(self.auth.jwks(), headers={"Cache-Control": "public, max-age=300"})

    @app.post("/v1/auth/token")
    async def issue_token(self, request: Request) -> dict[str, Any]:
        authorization = self.auth.authorization(request.headers)  # 400 if there are two
        api_key = await _api_key_in_body(request)
        # Rate limited per key before anything is signed; store lookups and signing run off the loop.
        return await self.auth.issue_token(authorization, api_key)

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> dict[str, Any]:
        caller = await self._caller(request)
        await self.states.ensure_fresh()
        cards = [self._model_card(model_id) for model_id in self.models if caller.allows_model(model_id)]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request) -> dict[str, Any]:
        caller = await self._caller(request)
        model_id = self._resolve(model)
        self.auth.authorize_model(caller, model_id)
        await self.states.ensure_fresh()
        return self._model_card(model_id)

    @app.post("/v1/models/load")
    async def load_model(self, request: Request) -> JSONResponse:
        """Bring a model up in this region (admin). 202 while it loads; poll GET /v1/models/{id}."""
        return await self._set_wanted(request, "loaded")

    @app.post("/v1/models/unload")
    async def unload_model(self, request: Request) -> JSONResponse:
        """Stop a model's replicas in this region (admin); in-flight requests finish first."""
        return await self._set_wanted(request, "cold")

    @app.get("/v1/admin/keys")
    async def admin_list_keys(self, request: Request) -> dict[str, Any]:
        await self._caller(request, SCOPE_ADMIN)
        return {"object": "list", "data": await asyncio.to_thread(self.auth.list_keys)}

    @app.post("/v1/admin/keys/{key_id}/revoke")
    async def admin_revoke_key(self, key_id: str, request: Request) -> dict[str, Any]:
        await self._caller(request, SCOPE_ADMIN)
        if not await asyncio.to_thread(self.auth.revoke_key, key_id):
            raise APIError(404, f"no API key {key_id!r}", param="key_id", code="key_not_found")
        return {"key_id": key_id, "revoked": True}

    @app.get("/v1/usage")
    async def usage(self, request: Request):
        """Usage totals from the ledger (docs/usage.md): the caller's key's, by day, month, model or region."""
        return await metering.usage_report(
            self.meter, lambda scope: self._caller(request, scope), request.query_params
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await inference.serve(self, request, inference.CHAT, _read_body_within_limit)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await inference.serve(self, request, inference.COMPLETIONS, _read_body_within_limit)

    @app.post("/v1/responses")
    async def create_response(self, request: Request):
        return await inference.serve(self, request, inference.RESPONSES, _read_body_within_limit)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request) -> dict[str, Any]:
        return await self.responses.retrieve(response_id, await self._caller(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> dict[str, Any]:
        return await self.responses.delete(response_id, await self._caller(request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request) -> dict[str, Any]:
        return await self.responses.cancel(response_id, await self._caller(request))

    # Anthropic's API: its x-api-key header is a credential here, and errors come in its shape.
    @app.post("/v1/messages")
    async def messages(self, request: Request):
        return await inference.serve(self, request, inference.MESSAGES, _read_body_within_limit)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        return await inference.serve(self, request, inference.COUNT_TOKENS, _read_body_within_limit)

    # vLLM's own spellings (it serves no /v1/ ones); answered by the replica's tokenizer.
    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        return await tokenization.relay(self, request, "tokenize", _read_body_within_limit)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return await tokenization.relay(self, request, "detokenize", _read_body_within_limit)

    async def _set_wanted(self, request: Request, wanted: str) -> JSONResponse:
        caller = await self._caller(request, SCOPE_ADMIN)
        model_id = self._resolve(await _model_in_body(request))
        self.auth.authorize_model(caller, model_id)  # an admin scoped to some models manages only those
        await self.states.ensure_fresh()
        state = await self.states.set_wanted(model_id, wanted, by=caller.key_id)
        logger.info("%s set %s to %s in region %s", caller.key_id, model_id, wanted, self.region)
        settled = state.state in (LOADED, COLD)
        return JSONResponse(self._model_card(model_id), status_code=200 if settled else 202)

    async def _fail_over(
        self, request: Request, route: str, body: dict[str, Any], caller: Principal, exchange: Exchange, local: APIError
    ):
        """Forward to the first peer region that takes the request, or None (answer ``local``).

        One hop: a request that was itself forwarded is never forwarded again. The caller's own
        credential never leaves this region: each peer gets a token minted here for the same key
        and claims, whose audience is that peer alone and which lives a minute at most, so a peer
        (or anyone on the way) cannot replay it elsewhere or for long.
        """
        if is_forwarded(request.headers) or not any(caller.allows_region(p.region) for p in self.forwarder.peers):
            return None
        reason = local.code or "unavailable"
        headers = exchange.start_failover(reason)
        # The region that serves the request records its usage: this one only if no peer took it
        # (a client gone meanwhile may have been admitted there: not recorded here either).
        bill, exchange.bill = exchange.bill, None
        try:
            peers = [p.region for p in self.forwarder.peers if p.region != self.region and caller.allows_region(p.region)]
            # Minted up front in a thread: a key-store cache miss must not block the event loop.
            bound = await asyncio.to_thread(
                lambda: {region: f"Bearer {self.auth.forwarding_token(caller, region)}" for region in peers}
            )
            forwarded = await self.forwarder.forward(
                route, body, headers, reason=reason, allowed=caller.allows_region,
                on_done=exchange.forwarded_done,  # a relayed stream: when its last byte is out
                authorization=bound.__getitem__,
            )
        except Exception:  # not a client gone (CancelledError): nothing reached a peer's engine
            exchange.bill = bill
            raise
        if forwarded.response is None:
            exchange.bill = bill
        exchange.note_failover(forwarded)
        if forwarded.response is not None and not forwarded.stream:
            exchange.forwarded_done(forwarded.status, forwarded.error_type)
        return forwarded.response

    async def _caller(self, request: Request, scope: str = SCOPE_INFERENCE, *, api_key_header: bool = False) -> Principal:
        authorization = self.auth.authorization(request.headers, api_key_header=api_key_header)  # 400 if two
        return await self.auth.authenticate_async(authorization, scope=scope)

    def _resolve(self, name: Any) -> str:
        if not isinstance(name, str) or not name.strip():
            raise APIError(400, "you must provide a model parameter", param="model", code="missing_model")
        model_id = catalog.canonical_id(name)
        if model_id is None or model_id not in self.models:
            raise APIError(
                404,
                f"The model {name!r} does not exist or is not served in region {self.region}. "
                f"Served here: {', '.join(self.models)}",
                param="model",
                code="model_not_found",
            )
        return model_id

    def _model_card(self, model_id: str) -> dict[str, Any]:
        entry = catalog.get(model_id)
        return {
            "id": model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "serve_app",
            "aliases": [entry.hf_repo, *entry.aliases],
            "max_model_len": entry.engine.max_model_len,
            "region": self.region,
            **self.states.get(model_id).to_json(),
        }
