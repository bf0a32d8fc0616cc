"""The router deployment: the FastAPI ingress every request enters through.

Request path, top to bottom: Serve proxy → ``Router`` (read body, resolve alias, pick the model's
handle) → ``ModelServer`` over a streaming handle → vLLM. The router never imports vLLM; it relays
the replica's head (status + body) and, for streams, the replica's SSE events unchanged.
"""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import catalog
from serve_app.errors import APIError, error_body

logger = logging.getLogger("ray.serve")

# Retry hint for load shedding: long enough for autoscaling to react, short for an SDK retry loop.
OVERLOADED_RETRY_AFTER_S = 2

app = FastAPI(title="serve_app", docs_url=None, redoc_url=None)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(400, f"invalid request: {exc.errors()[:3]}"), status_code=400)


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in router")
    return JSONResponse(error_body(500, "internal error; it has been logged"), status_code=500)


# Helpers stand above the class: serve.ingress pickles the FastAPI app when the class is
# decorated, so names defined below it would be missing in the replica.
async def _read_json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


async def _relay_events(stream) -> AsyncIterator[str]:
    """Forward the replica's SSE events as they arrive; a client that leaves cancels the replica."""
    finished = False
    try:
        async for event in stream:
            yield event
        finished = True
    except Exception:
        # The status line is sent already: end the stream with an error event, never a hang.
        logger.exception("stream from model replica failed")
        yield f"data: {json.dumps(error_body(500, 'the model replica failed mid-stream'))}\n\n"
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away: abort the engine request, free its KV cache
            stream.cancel()


@serve.deployment
@serve.ingress(app)
class Router:
    def __init__(self, models: dict[str, DeploymentHandle], region: str):
        self.models = models
        self.region = region
        self.created = int(time.time())

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """Ready when every model has a replica that answers its engine health check."""
        checks = await asyncio.gather(
            *(self._model_ready(handle) for handle in self.models.values()), return_exceptions=True
        )
        models = {model_id: ok is True for model_id, ok in zip(self.models, checks)}
        healthy = all(models.values())
        return JSONResponse(
            {"status": "ok" if healthy else "unavailable", "region": self.region, "models": models},
            status_code=200 if healthy else 503,
        )

    @app.get("/v1/models")
    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card(model_id) for model_id in self.models]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str) -> dict[str, Any]:
        return self._model_card(self._resolve(model))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._relay(request, "chat")

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._relay(request, "completions")

    async def _relay(self, request: Request, method: str):
        body = await _read_json_object(request)
        body["model"] = self._resolve(body.get("model"))
        handle = self.models[body["model"]]
        stream = getattr(handle.options(stream=True), method).remote(body)
        try:
            head = await stream.__anext__()
        except BackPressureError:
            raise APIError(
                503,
                f"{body['model']} is at capacity in region {self.region}; retry shortly",
                code="overloaded",
                headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)},
            ) from None
        except RayActorError:
            logger.exception("model replica for %s died", body["model"])
            raise APIError(
                503,
                f"{body['model']} replica became unavailable; retry shortly",
                code="replica_unavailable",
                headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)},
            ) from None
        if not head["stream"]:
            return JSONResponse(head["body"], status_code=head["status"])
        return StreamingResponse(_relay_events(stream), media_type="text/event-stream")

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
        }

    @staticmethod
    async def _model_ready(handle: DeploymentHandle) -> bool:
        # A bounded wait: an engine that cannot answer in this time is not ready for traffic.
        await asyncio.wait_for(handle.check_health.remote(), timeout=10)
        return True
