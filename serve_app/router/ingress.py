"""The router deployment: the FastAPI ingress every request enters through, and its routes.

Each route hands its request to the pipeline (``pipeline.py``: every surface that runs on a model
replica) or to ``operations.py`` (health, models, hot-load, key admin, usage, stored responses,
tokens), with the replica's ``Services`` (``services.py``). The surfaces' routes are made from
their rows (``serve_app/surfaces``, ``_with_surface_routes``): a new surface needs no route
written here. The router never imports vLLM.
"""

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app import surfaces
from serve_app.auth.refusals import registry_unavailable
from serve_app.auth.database import RegistryUnavailable
from serve_app.config import AppArgs, ModelDeploymentArgs, parse_app_args
from serve_app.errors import APIError
from serve_app.regions.layout import ROUTER_DEPLOYMENT, merge_settings, model_app_name
from serve_app.router import openapi, operations, pipeline
from serve_app.router.context import wait_settled
from serve_app.router.request_schema import describe_validation_errors
from serve_app.router.services import Services
from serve_app.runtime import cpus, heap, http_tick
from serve_app.surfaces.dialects import ANTHROPIC, OPENAI, Dialect
from serve_app.telemetry.config import TelemetryArgs
from serve_app.telemetry.logs import module_logger
from serve_app.telemetry.metrics import setup_metrics
from serve_app.telemetry.tracing import flush_before_exit, setup_tracing

logger = module_logger(__name__)

# No redirect for a trailing slash: Starlette's is an empty-bodied 307 to a Location built from the
# router's own hop (``http://``), which an SDK follows without its credentials; a 404 in the
# route's own shape says what is wrong (``_http_error``).
app = FastAPI(title="serve_app", docs_url=None, redoc_url=None, redirect_slashes=False)


_MESSAGES = surfaces.MESSAGES.route


def _dialect_of(request: Request) -> Dialect:
    """The error shape of the API a path belongs to: Anthropic's under ``/v1/messages`` (a wrong
    method or a path below it included), OpenAI's everywhere else."""
    path = request.url.path.rstrip("/")
    return ANTHROPIC if path == _MESSAGES or path.startswith(_MESSAGES + "/") else OPENAI


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _dialect_of(request).error_response(exc)


openapi.install(app)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message, path = str(exc.detail), request.url.path
    if exc.status_code == 404 and path.endswith("/") and _is_route(path.rstrip("/")):
        message = f"no route {path!r}: the route is {path.rstrip('/')!r}, without the trailing slash"
    # A 405 carries Starlette's Allow header: the methods the path does take.
    error = APIError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
    return _dialect_of(request).error_response(error)


def _is_route(path: str) -> bool:
    return any(route.path_regex.match(path) for route in app.router.routes if hasattr(route, "path_regex"))


@app.exception_handler(RegistryUnavailable)
async def _registry_unavailable(_: Request, exc: RegistryUnavailable) -> JSONResponse:
    """Wherever the key registry was needed (token endpoint, admin routes): 503, not 500."""
    return await _api_error(_, registry_unavailable(exc))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _dialect_of(request).error_response(describe_validation_errors(exc.errors()))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in router")
    return _dialect_of(request).error_response(APIError(500, "internal error; it has been logged"))


def _with_surface_routes(cls: type) -> type:
    """One POST route per surface, made from its row: its request goes through the pipeline with
    the row. Serve's ingress binds a route to the class by its endpoint's ``__qualname__``."""
    for surface in surfaces.SURFACES:
        route = _surface_route(surface)
        route.__name__, route.__qualname__ = surface.name, f"{cls.__qualname__}.{surface.name}"
        setattr(cls, surface.name, app.post(surface.route, name=surface.name)(route))
    return cls


def _surface_route(surface: surfaces.Surface):
    async def route(self, request: Request):
        return await pipeline.run(self.services, request, surface)

    return route


RETRY_FIRST_S, RETRY_MAX_S = 2.0, 60.0  # a refused user_config is tried again, the wait doubling


async def _apply(services: Services, args: Any, handle: Any) -> bool:
    """Apply a new user_config in place; False when it could not be and trying again may help."""
    try:
        changed = await services.reconfigure(args, handle)
    except ValueError:  # settings read at start: a restart applies them, trying again never
        logger.exception("the Router's new user_config cannot be applied in place; serving on the previous one")
        return True
    except Exception:
        logger.exception("could not apply the Router's new user_config; serving on the previous one, trying again")
        return False
    logger.info("settings changed in place: %s", ", ".join(changed) or "none")
    return True


async def _retry_apply(services: Services, args: Any, handle: Any) -> None:
    wait_s = RETRY_FIRST_S
    while True:
        await asyncio.sleep(wait_s)
        if await _apply(services, args, handle):
            return
        wait_s = min(2 * wait_s, RETRY_MAX_S)


@serve.deployment
@serve.ingress(app)
@_with_surface_routes
class Router:
    """The region's settings reach a replica in two parts (serve_app/regions/layout.py): what it
    reads once, when it starts (its application's args: ``startup``), and the rest as its
    deployment's ``user_config``, which Serve passes to ``reconfigure`` right after ``__init__``
    (before the replica takes a request) and again, in place, whenever a ``serve deploy`` changes
    it."""

    async def __init__(self, startup: dict[str, Any]):
        context = serve.get_replica_context()
        self.app_name, self.replica = context.app_name, context.replica_id.unique_id
        cpus.keep_off_engine_cores("router replica")  # on a CPU host (runtime/cpus.py)
        http_tick.install()  # before Serve starts this replica's HTTP server: one idle wake-up a second
        self.startup = startup
        telemetry = TelemetryArgs.model_validate(startup.get("telemetry") or {})
        region = startup.get("region", AppArgs.model_fields["region"].default)
        # This process owns the global tracer provider (docs/operations.md, "Tracing").
        setup_tracing(telemetry, region=region, deployment=ROUTER_DEPLOYMENT, replica=self.replica)
        setup_metrics(telemetry)
        self.services: Services | None = None
        self.retrying: asyncio.Task | None = None  # a user_config this replica could not apply yet

    async def reconfigure(self, settings: dict[str, Any]) -> None:
        """Serve's ``user_config``: the first one builds the services; a later one changes them in
        place (``Services.reconfigure``). A later one that is invalid, or that cannot be applied,
        is refused with an ERROR in this replica's log and the replica keeps serving on what it
        has: raising would make Serve stop it, and a replacement would fail the same way. One
        that failed for a reason that may pass (the key registry away) is tried again in the
        background, the wait doubling from 2 s to a minute, until it applies or a newer one comes."""
        try:
            args = parse_app_args(merge_settings(self.startup, settings))
        except ValueError as err:
            if self.services is None:
                raise
            logger.error("the Router's new user_config is invalid; serving on the previous one:\n%s", err)
            return
        if self.services is None:
            self.services = Services.build(self.handle, args, app_name=self.app_name, replica=self.replica)
            # Before the first request: a real key arriving first is never budgeted as a made-up id.
            await self.services.auth.list_key_ids()
            self.services.start()
            heap.freeze_startup()  # start-up's objects, out of the collector's reach
            return
        if getattr(self, "retrying", None) is not None:  # a newer config supersedes one being retried
            self.retrying.cancel()
        self.retrying = None
        if not await _apply(self.services, args, self.handle):
            # Serve sends a config once: a replica that failed to apply it (the key registry away
            # a moment) would serve the old one until the next deploy, unlike the region's others.
            self.retrying = asyncio.get_running_loop().create_task(_retry_apply(self.services, args, self.handle))

    def handle(self, model_id: str) -> DeploymentHandle:
        """The model's deployment, in its own application. Not checked to exist: every application
        of a config is deployed at once, and a router may start before a model's is built (the
        hot-load state says ``loading`` until Serve reports its replicas)."""
        return serve.get_deployment_handle(
            ModelDeploymentArgs.deployment_name_of(model_id), app_name=model_app_name(self.app_name, model_id),
            _check_exists=False,
        )

    async def check_health(self) -> None:
        if self.services is None:  # Serve ran no reconfigure: the config gave no user_config
            raise RuntimeError(
                f"the {ROUTER_DEPLOYMENT} deployment has no user_config: its settings belong there "
                "(serve_app/regions/layout.py; render the config with `serve-app regions render`)"
            )

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica: abandoned requests' last items (their
        usage records), then the ledger's last write, the state refresh, peer connections, and
        last the spans still batched (their requests are all closed by then). Serve kills the
        actor afterwards: no atexit hook would export them."""
        if self.retrying is not None:
            self.retrying.cancel()
        try:
            await wait_settled()
            if self.services is not None:
                await self.services.aclose()
        finally:
            await flush_before_exit()

    # --- without a credential ---------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        return await operations.health(self.services)

    @app.get("/.well-known/jwks.json")
    async def jwks(self) -> JSONResponse:
        """Public by design: the keys any region verifies our tokens with."""
        return JSONResponse(self.services.auth.jwks(), headers={"Cache-Control": "public, max-age=300"})

    @app.post("/v1/auth/token")
    async def issue_token(self, request: Request) -> dict[str, Any]:
        return await operations.issue_token(self.services, request)

    @app.post("/v1/auth/token/revoke")
    async def revoke_token(self, request: Request) -> dict[str, Any]:
        """Revoke one token before it expires (by its own key, or by whoever manages that key); the key stays."""
        return await operations.revoke_token(self.services, request)

    # --- models and hot-load ----------------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models(self, request: Request) -> dict[str, Any]:
        return await operations.list_models(self.services, request)

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, request: Request) -> dict[str, Any]:
        return await operations.retrieve_model(self.services, model, request)

    @app.post("/v1/models/load")
    async def load_model(self, request: Request) -> JSONResponse:
        """Bring a model up in this region (admin). 202 while it loads; poll GET /v1/models/{id}."""
        return await operations.set_wanted(self.services, request, "loaded")

    @app.post("/v1/models/unload")
    async def unload_model(self, request: Request) -> JSONResponse:
        """Stop a model's replicas in this region (admin); in-flight requests finish first."""
        return await operations.set_wanted(self.services, request, "cold")

    # --- stored responses, usage, keys ------------------------------------------------------------
    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request) -> dict[str, Any]:
        # A Response object (the annotation is the OpenAPI schema): its JSON as stored, not re-encoded.
        return await operations.retrieve_response(self.services, response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> dict[str, Any]:
        return await operations.delete_response(self.services, response_id, request)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request) -> dict[str, Any]:
        return await operations.cancel_response(self.services, response_id, request)

    @app.get("/v1/usage")
    async def usage(self, request: Request):
        """Usage totals from the ledger (docs/usage.md): the caller's key's, by day, month, model or region."""
        return await operations.usage(self.services, request)

    @app.get("/v1/admin/keys")
    async def admin_list_keys(self, request: Request) -> dict[str, Any]:
        return await operations.list_keys(self.services, request)

    @app.post("/v1/admin/keys/{key_id}/revoke")
    async def admin_revoke_key(self, key_id: str, request: Request) -> dict[str, Any]:
        return await operations.revoke_key(self.services, key_id, request)

