"""The published ``/openapi.json``: the request bodies the router validates and the errors it
answers, so contract fuzzers (schemathesis, ``serve-app faults``) test what the app really does.

FastAPI cannot infer either: the inference and admin routes read the raw body themselves (to
refuse oversized and deeply nested bodies before parsing, and to forward the parsed dict without
a re-encode), and every client error is answered 400 in OpenAI's shape, never FastAPI's 422.

The schema is public (like ``/health``), so it leaves the admin routes out (``/v1/admin/*``,
``/v1/models/load`` and ``/unload``): who may revoke keys or unload models is not something to
advertise to anyone who asks, and contract fuzzers must not unload a region's model. Their
contract is in docs/api.md and docs/auth.md.
"""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from starlette.routing import BaseRoute

from serve_app.surfaces import SURFACES, dialects

_REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the router answers, whatever failed (serve_app/errors.py)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error on the Anthropic routes (``/v1/messages``…), in Anthropic's shape."""

    type: str
    error: AnthropicErrorDetail


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: str | None = None  # without it, the Bearer credential is the key


class TokenRevocation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: str  # a token of the caller's key, or of a key the caller administers


# Every surface's strict body (serve_app/surfaces), and the token endpoints'.
_BODIES: dict[str, type[BaseModel]] = {
    **{surface.route: surface.body for surface in SURFACES},
    "/v1/auth/token": TokenRequest,
    "/v1/auth/token/revoke": TokenRevocation,
}
_ANTHROPIC_PATHS = tuple(surface.route for surface in SURFACES if surface.dialect is dialects.ANTHROPIC)
# Routes that need the admin scope: served, never published.
_ADMIN_PATHS = ("/v1/models/load", "/v1/models/unload")
_ADMIN_PREFIX = "/v1/admin/"
# What each kind of route may answer besides success (docs/api.md, "Errors").
_PUBLIC = {"/health": (503,), "/.well-known/jwks.json": ()}
_INFERENCE_ERRORS = (400, 401, 403, 404, 413, 415, 429, 503)
# Bodies of the routes that go through a model replica (and so may answer 413, 429 and 503).
_INFERENCE_BODIES = tuple(surface.body for surface in SURFACES)
_OTHER_ERRORS = (400, 401, 403, 404)
# The token endpoints: a body past its bound, their own rate limit, the registry away.
_TOKEN_PATHS = ("/v1/auth/token", "/v1/auth/token/revoke")
_TOKEN_ERRORS = (400, 401, 403, 404, 413, 429, 503)
_DESCRIPTIONS = {
    400: "Invalid request: the failing field is named in `param`",
    401: "Missing, invalid or expired credential",
    403: "The credential lacks the scope, model or region",
    404: "No such model, key or route",
    413: "Request body too large",
    415: "A compressed request body (Content-Encoding): bodies are read uncompressed",
    429: "Rate limit reached; see Retry-After",
    503: "Not available here now (overloaded, loading, recovering); see Retry-After",
}


def install(app: FastAPI) -> None:
    """Serve the accurate schema from ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi


def is_admin_path(path: str) -> bool:
    return path in _ADMIN_PATHS or path.startswith(_ADMIN_PREFIX)


def _published(routes: list[BaseRoute]) -> list[BaseRoute]:
    return [route for route in routes if not is_admin_path(getattr(route, "path", ""))]


def build(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=_published(app.routes))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ErrorResponse, AnthropicErrorResponse, *_BODIES.values()):
        definition = model.model_json_schema(ref_template=_REF, mode="validation")
        components.update(definition.pop("$defs", {}))
        components[model.__name__] = definition
    # Nothing the router answers is FastAPI's 422 shape.
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            if model := _BODIES.get(path):
                operation["requestBody"] = {
                    "required": model is not TokenRequest,
                    "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
                }
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            statuses = _PUBLIC.get(path, _TOKEN_ERRORS if path in _TOKEN_PATHS else
                                   _INFERENCE_ERRORS if model in _INFERENCE_BODIES else _OTHER_ERRORS)
            error_model = "AnthropicErrorResponse" if path in _ANTHROPIC_PATHS else "ErrorResponse"
            for status in statuses:
                responses[str(status)] = {
                    "description": _DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": {"$ref": _REF.format(model=error_model)}}},
                }
    return schema
