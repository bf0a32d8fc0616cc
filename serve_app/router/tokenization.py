"""``POST /tokenize`` and ``POST /detokenize`` at the router: the chat path's checks, one handle call.

The model replica answers them with vLLM's own tokenization serving object (the model's
tokenizer and chat template live there, not here), so a count from ``/tokenize`` is the count
chat and completions will see. At the router they go through what chat goes through —
credential (inference scope), body size, strict validation, alias resolution, the caller's model
scope, the region's model state — with two differences: the rate limiter charges one request
and ``TOKENIZE_TOKEN_COST`` tokens (no completion is generated, so chat's estimate of prompt plus
``max_tokens`` would over-charge a client that counts tokens to stay under its limit), and a
model that is not loaded here is a 503 with ``Retry-After``, not forwarded to a peer region.
"""

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

from serve_app.router.failover import REGION_HEADER
from serve_app.router.relay import Exchange, call_model, json_response
from serve_app.router.request_schema import parse_json_object, validate_body

ROUTE_TOKENIZE = "/tokenize"
ROUTE_DETOKENIZE = "/detokenize"
ROUTES = {"tokenize": ROUTE_TOKENIZE, "detokenize": ROUTE_DETOKENIZE}
# What one tokenization call charges against tokens/min, beside the one request: a token, so
# the request still shows in the token window, but never the prompt's size.
TOKENIZE_TOKEN_COST = 1


async def relay(router: Any, request: Request, method: str, read_body: Callable[[Request], Awaitable[bytes]]):
    """Serve ``method`` (``tokenize`` or ``detokenize``) for ``router`` (the ``Router`` replica).

    ``read_body`` is the router's size-limited body reader, so a tokenization body gets the same
    413 as any inference body.
    """
    exchange = Exchange(ROUTES[method], request.headers, region=router.region, replica=router.replica)
    with exchange.failures_recorded():
        with exchange.record.measure_auth():
            caller = await router._caller(request)  # 401 / 403 before the body is even read
        body = parse_json_object(await read_body(request))
        exchange.record.note_request(body)
        body["model"] = exchange.record.model = router._resolve(body.get("model"))
        validate_body(method, body)
        router.auth.authorize_model(caller, body["model"])
        limits = await router.auth.admit(caller, TOKENIZE_TOKEN_COST)
        await router.states.ensure_fresh()
        router.states.require_serving(body["model"], router.region)
        exchange.hold_slot(router.in_flight.begin(body["model"]))
        _, head = await call_model(router.streaming[body["model"]], method, body, router.region, exchange)
    limits[REGION_HEADER] = router.region
    return json_response(head, exchange, limits)
