"""The router's routes that run on no model replica: health, model cards and hot-load, key admin,
usage reports and stored responses.

Every route that takes a credential is metered: it costs the key one request of its rate limit
(no tokens), like an inference request's admission, so a key cannot query the registry, the
ledger or the response store faster than its tier allows.
"""

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serve_app import catalog
from serve_app.auth import admin, tokens
from serve_app.auth.keys import SCOPE_ADMIN, SCOPE_INFERENCE, SCOPE_OPERATOR, is_key_id
from serve_app.auth.principal import Principal, forbidden
from serve_app.errors import APIError
from serve_app.hot_load.state import COLD, LOADED, RECOVERING
from serve_app.router.request_schema import parse_json_object
from serve_app.router.body import read_body
from serve_app.router.services import Services
from serve_app.telemetry.logs import module_logger
from serve_app.usage import report
from serve_app.usage.records import utc_day

logger = module_logger(__name__)

# /health re-reads Serve's status when its view is older than this (probes come every few seconds).
HEALTH_STATUS_MAX_AGE_S = 2.0
# ...but never waits longer than this for it: a slow controller makes the answer older, not late.
HEALTH_WAIT_S = 0.25


async def metered_caller(services: Services, request: Request, scope: str = SCOPE_INFERENCE) -> Principal:
    """The caller (401/403), charged one request of its rate limit (429)."""
    caller = await services.caller(request, scope)
    await services.auth.admit(caller, 0)
    return caller


async def health(services: Services) -> JSONResponse:
    """Liveness and readiness for the load balancer and the global DNS health check.

    Read from Serve's own view of its replicas — which its health checks keep — and this router's
    count of in-flight requests, never through a model's request slots, so it answers at once
    however busy the region is. 200 while a model serves and every model marked
    ``region_health: required`` does: ``status`` is ``ok``; ``degraded`` when a model wanted
    loaded does not serve (its requests fail over to a peer one by one; said before ``busy``);
    ``busy`` when every serving model's slots are taken (requests queue or are shed, but the region
    serves). 503 when no model serves or a required one does not, so global routing sends the
    region's traffic elsewhere: ``recovering`` while Serve replaces a failed replica of it, else
    ``unavailable``; and 503 ``registry_unavailable`` while the models serve but the key registry
    cannot be read (every credential not cached here is refused: serve_app/auth/registry_probe.py).
    A model an admin unloads is no degradation; a required one cannot be unloaded (``set_wanted``).
    """
    registry_readable, _ = await asyncio.gather(  # each waits HEALTH_WAIT_S at most, side by side
        services.auth.registry.check(HEALTH_WAIT_S),
        services.states.ensure_fresh(max_status_age_s=HEALTH_STATUS_MAX_AGE_S, wait_s=HEALTH_WAIT_S),
    )
    states = {model_id: services.states.get(model_id) for model_id in services.served}
    load = {model_id: services.in_flight.load(model_id, state.running) for model_id, state in states.items()}
    required = [model_id for model_id in states if services.models[model_id].required_for_health]
    serving = [model_id for model_id, state in states.items() if state.serving]
    required_down = [model_id for model_id in required if not states[model_id].serving]
    healthy = bool(serving) and not required_down
    if not healthy:  # named after what keeps the region out: its required models, or all of them
        down = required_down or list(states)
        status = "recovering" if any(states[model_id].state == RECOVERING for model_id in down) else "unavailable"
    elif not registry_readable:
        healthy, status = False, "registry_unavailable"
    elif any(state.wanted == "loaded" and not state.serving for state in states.values()):
        status = "degraded"
    else:
        status = "busy" if all(load[model_id]["busy"] for model_id in serving) else "ok"
    return JSONResponse(
        {
            "status": status,
            "region": services.region,
            "models": {model_id: state.serving for model_id, state in states.items()},
            "states": {model_id: state.state for model_id, state in states.items()},
            "required": required,
            "registry": "readable" if registry_readable else "unreadable",
            # Busy and shedding, not the counts: this answer needs no credential, and a tenant
            # polling exact in-flight counts would read every other tenant's traffic in the region.
            "load": {model_id: {"busy": now["busy"], "shedding": now["shedding"]} for model_id, now in load.items()},
        },
        status_code=200 if healthy else 503,
    )


# --- models --------------------------------------------------------------------------------------
async def list_models(services: Services, request: Request) -> dict[str, Any]:
    caller = await metered_caller(services, request)
    await services.states.ensure_fresh()
    cards = [model_card(services, model_id) for model_id in services.usable_by(caller)]
    return {"object": "list", "data": cards}


async def retrieve_model(services: Services, model: str, request: Request) -> dict[str, Any]:
    caller = await metered_caller(services, request)
    model_id = services.resolve(model, caller)
    services.auth.authorize_model(caller, model_id)
    await services.states.ensure_fresh()
    return model_card(services, model_id)


async def set_wanted(services: Services, request: Request, wanted: str) -> JSONResponse:
    """``POST /v1/models/load`` and ``/unload`` (admin): ``{"model": <id, alias or HF repo id>}``.
    200 when the model is already in that state, 202 while it gets there."""
    caller = await metered_caller(services, request, SCOPE_ADMIN)
    if not admin.manages_every_key(caller):
        # A model serves every owner in its region: an owner admin unloading one (even one of its
        # own models) would take it from every tenant, and loading one spends the region's GPUs.
        raise forbidden("loading and unloading a model is an operator's (a key with the operator scope): a model "
                        "serves every owner in the region", "insufficient_scope", SCOPE_OPERATOR)
    model_id = services.resolve(parse_json_object(await read_body(request)).get("model"))
    if wanted == "cold" and services.models[model_id].required_for_health:
        # Its region's /health would turn 503 and take the region out of the global name for
        # every tenant: that is a change of the region's settings, not an admin call.
        raise APIError(
            409,
            f"{model_id} is region {services.region}'s required model (region_health: required): unloading "
            "it would take the region out of global routing. Make it optional in the region's settings first.",
            param="model",
            code="model_required",
        )
    await services.states.ensure_fresh()
    state = await services.states.set_wanted(model_id, wanted, by=caller.key_id)
    logger.info("%s set %s to %s in region %s", caller.key_id, model_id, wanted, services.region)
    settled = state.state in (LOADED, COLD)
    return JSONResponse(model_card(services, model_id), status_code=200 if settled else 202)


def model_card(services: Services, model_id: str) -> dict[str, Any]:
    entry = catalog.get(model_id)
    return {
        "id": model_id,
        "object": "model",
        "created": services.created,
        "owned_by": "serve_app",
        "aliases": [entry.hf_repo, *entry.aliases],
        "task": entry.task,  # generate (chat, completions, Responses, Messages) or embed (/v1/embeddings)
        "max_model_len": entry.engine.max_model_len,
        "region": services.region,
        **services.states.get(model_id).to_json(),
    }


# --- key admin and usage ---------------------------------------------------------------------------
async def list_keys(services: Services, request: Request) -> dict[str, Any]:
    """Every key an operator admin may manage; an owner admin's own owner's (docs/auth.md)."""
    caller = await metered_caller(services, request, SCOPE_ADMIN)
    return {"object": "list", "data": await asyncio.to_thread(services.auth.list_keys, caller)}


async def revoke_key(services: Services, key_id: str, request: Request) -> dict[str, Any]:
    """Another owner's key is, to an owner admin, a key that does not exist (404)."""
    caller = await metered_caller(services, request, SCOPE_ADMIN)
    # A path that is no key id (a NUL, say) is no key: never a query the database would refuse.
    if not is_key_id(key_id) or not await asyncio.to_thread(services.auth.revoke_key, caller, key_id):
        raise APIError(404, f"no API key {key_id!r}", param="key_id", code="key_not_found")
    return {"key_id": key_id, "revoked": True}


async def usage(services: Services, request: Request) -> Response:
    """``GET /v1/usage`` (docs/usage.md): a key's own totals; with ``key_id`` (one key, or ``*``
    for all), an admin's view."""
    params: Mapping[str, str] = request.query_params
    key_id = params.get("key_id")
    caller = await metered_caller(services, request, admin.usage_scope(key_id))
    since, until, group_by = report.parse_query(params, today=utc_day(time.time()))
    fmt = params.get("format", "json")
    if fmt not in ("json", "csv"):
        raise APIError(400, f"format must be json or csv, not {fmt!r}", param="format", code="invalid_usage_query")
    wanted = admin.usage_filter(caller, key_id)  # an owner admin sees its own owner's keys only
    if wanted.owner is not None and wanted.key_id is not None and (
        await services.auth.key_owner(wanted.key_id) != wanted.owner
    ):
        # Another owner's key (or none): the empty report, without reading its usage, whose time
        # grew with that key's rows and told its id from one nobody holds.
        answer = report.report_of([], key_id=wanted.key_id, owner=wanted.owner, since=since, until=until,
                                  group_by=group_by)
    else:
        answer = await services.meter.reports.run(  # 429 usage_reports_busy: too many under way here
            report.usage_report, services.meter.store, key_id=wanted.key_id, owner=wanted.owner,
            since=since, until=until, group_by=group_by, caller_owner=caller.owner,
        )
    if fmt == "csv":
        return PlainTextResponse(report.to_csv(answer), media_type="text/csv")
    return JSONResponse(answer)


# --- stored responses ------------------------------------------------------------------------------
async def retrieve_response(services: Services, response_id: str, request: Request) -> Response:
    """The stored Response object's JSON, as stored (``ResponsesAPI.retrieve``)."""
    return await services.responses.retrieve(response_id, await metered_caller(services, request))


async def delete_response(services: Services, response_id: str, request: Request) -> dict[str, Any]:
    return await services.responses.delete(response_id, await metered_caller(services, request))


async def cancel_response(services: Services, response_id: str, request: Request) -> dict[str, Any]:
    return await services.responses.cancel(response_id, await metered_caller(services, request))


# --- tokens --------------------------------------------------------------------------------------
TOKEN_BODY_MAX_BYTES = 4096  # {"api_key": ...}: a key is ~60 bytes


async def issue_token(services: Services, request: Request) -> dict[str, Any]:
    """``POST /v1/auth/token``: an API key (``{"api_key": ...}``, else the Bearer value) for a JWT.
    Rate limited per key before anything is signed; store lookups and signing run off the loop."""
    authorization = services.auth.authorization(request.headers)  # 400 if there are two
    api_key = None
    if request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers:
        # The body is read before any credential is known: no bigger than a key needs.
        too_large = APIError(413, f'the token endpoint takes {{"api_key": ...}}, at most {TOKEN_BODY_MAX_BYTES} bytes',
                             code="request_too_large")
        api_key = parse_json_object(await read_body(request, refuse_past=(TOKEN_BODY_MAX_BYTES, too_large))).get(
            "api_key")
        if api_key is not None and not isinstance(api_key, str):
            raise APIError(400, "api_key must be a string", param="api_key", code="invalid_api_key_field")
    return await services.auth.issue_token(authorization, api_key or None)


async def revoke_token(services: Services, request: Request) -> dict[str, Any]:
    """``POST /v1/auth/token/revoke`` ``{"token": ...}``: one token, before it expires, by the key
    it was minted for or an admin of that key (a leaked token, without revoking the key). Another
    owner's token is, to the caller, no token (404), as another owner's key is. Not charged to the
    key's requests, which the leaked token may be spending: the write is, to a bucket of its own."""
    caller = await services.caller(request)
    limit = tokens.MAX_TOKEN_BYTES + 64  # the token, in {"token": "..."}
    too_large = APIError(413, f'the token revocation takes {{"token": ...}}, at most {limit} bytes',
                         code="request_too_large")
    token = parse_json_object(await read_body(request, refuse_past=(limit, too_large))).get("token")
    if not isinstance(token, str) or not token:
        raise APIError(400, "token: the token to revoke, a string", param="token", code="invalid_token_field")
    try:
        revoking = await asyncio.to_thread(services.auth.token_to_revoke, caller, token)
    except tokens.TokenError as err:
        if err.code == "token_expired":  # no request accepts it any more: nothing to revoke
            return {"jti": None, "revoked": False, "reason": "expired"}
        raise APIError(400, f"token: {err}", param="token", code="invalid_token") from None
    if revoking is None:
        raise APIError(404, "no such token of a key this credential manages", param="token", code="token_not_found")
    jti, purge_after = revoking
    await services.auth.admit_revocation(caller)  # 429 past the key's token rate
    await asyncio.to_thread(services.auth.keys.revoke_jti, jti, purge_after=purge_after)
    logger.info("%s revoked token %s", caller.key_id, jti)
    return {"jti": jti, "revoked": True}
