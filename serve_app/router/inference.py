"""The router's inference path, top to bottom, for every API surface that runs on a model replica:
chat, completions, Responses and Anthropic Messages (``/tokenize`` has its own, ``tokenization.py``).

Credential (401/403 before the body is read) → body (size, JSON, strict validation per surface) →
alias → completion budget → model scope → Responses' conversation (``responses.py``) → token
budget and rate limit → a usage record once it is over (``metering.py``) → tier priority → the
model's state here → a replica (head, then for a stream the byte socket) → the answer; a 503 from
this region fails over to a peer once. What differs per endpoint family is one ``Family`` row:
the replica method (and its strict body model, ``request_schema.BODIES``), the stream's ending and
error shape (``dialects.py``), Anthropic's credential header and error shape, the conversation
store (Responses), and whether it generates tokens (budget, ledger).
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from serve_app.auth.ratelimit import request_token_cost
from serve_app.errors import APIError
from serve_app.router import dialects
from serve_app.router.client_socket import RelayedStream
from serve_app.router.failover import HOP_HEADER, REGION_HEADER
from serve_app.router.relay import (
    REPLICA_FAILURES, Exchange, abandon_unrelayed, call_model, json_response, open_byte_stream, relay_events,
)
from serve_app.router.request_schema import parse_json_object, validate_body
from serve_app.router.tokenization import TOKENIZE_TOKEN_COST
from serve_app.telemetry.timing import ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_COUNT_TOKENS, ROUTE_MESSAGES, ROUTE_RESPONSES

ReadBody = Callable[[Request], Awaitable[bytes]]


@dataclass(frozen=True)
class Family:
    """One endpoint family: what differs between the routes that run on a model replica."""

    route: str
    method: str  # the replica's method, and the strict body model (``request_schema.BODIES``)
    dialect: Any = dialects.CHAT  # how its stream ends and its errors look
    anthropic: bool = False  # Anthropic's API: x-api-key is a credential, errors in its shape
    conversation: bool = False  # Responses: previous_response_id continues a stored conversation
    # Whether it generates tokens: charged the prompt and completion budget against the rate
    # limit, checked against the key's token budget, recorded in the usage ledger. Counting
    # tokens generates none: a flat rate-limit cost like /tokenize, no budget, no record.
    generates: bool = True


CHAT = Family(ROUTE_CHAT, "chat")
COMPLETIONS = Family(ROUTE_COMPLETIONS, "completions")
RESPONSES = Family(ROUTE_RESPONSES, "responses", dialects.RESPONSES, conversation=True)
MESSAGES = Family(ROUTE_MESSAGES, "messages", dialects.MESSAGES, anthropic=True)
COUNT_TOKENS = Family(ROUTE_COUNT_TOKENS, "count_tokens", dialects.MESSAGES, anthropic=True, generates=False)


async def serve(router: Any, request: Request, family: Family, read_body: ReadBody):
    """Serve one request of ``family`` for ``router`` (the ``Router`` replica); ``read_body`` is
    its size-limited body reader (413). On Anthropic's routes every error is in its shape,
    whoever raised it."""
    if not family.anthropic:
        return await relay(router, request, family, read_body)
    try:
        response = await relay(router, request, family, read_body)
    except APIError as err:
        return dialects.anthropic_error(err)
    return dialects.anthropic_errors_only(response)


async def relay(router: Any, request: Request, family: Family, read_body: ReadBody):
    exchange = Exchange(family.route, request.headers, region=router.region, replica=router.replica)
    keep = None
    with exchange.failures_recorded():  # every refusal ends the request's spans once
        with exchange.record.measure_auth():
            caller = await router._caller(request, api_key_header=family.anthropic)  # 401 / 403 before the body
        raw = await read_body(request)
        body = parse_json_object(raw)  # 400 invalid_json, however it nests
        exchange.record.note_request(body)  # alias, stream flag, sampling numbers; no text
        body["model"] = exchange.record.model = router._resolve(body.get("model"))
        validate_body(family.method, body)  # 400 naming the failing field
        check_completion_budget(body, router.max_model_len[body["model"]])
        router.auth.authorize_model(caller, body["model"])
        cost_bytes = len(raw)
        if family.conversation:  # previous_response_id: the router continues the conversation
            keep, history_bytes = await router.responses.continue_from(body, caller)
            cost_bytes += history_bytes
        cost = request_token_cost(body, cost_bytes) if family.generates else TOKENIZE_TOKEN_COST
        budget = await router.meter.check_budget(caller) if family.generates else {}  # 429 budget_exceeded
        limits = {**await router.auth.admit(caller, cost), **budget}  # 429 + Retry-After
        if family.generates:  # recorded once it is over, by the region that serves it
            exchange.bill = router.meter.biller(caller, origin=request.headers.get(HOP_HEADER))
        body["priority"] = router.auth.priority(caller, body.get("priority"))  # the tier's, or lower
        try:
            await router.states.ensure_fresh()
            router.states.require_serving(body["model"], router.region)  # 503 unless loaded here
            exchange.hold_slot(router.in_flight.begin(body["model"]))
            stream, head = await call_model(router.streaming[body["model"]], family.method, body, router.region, exchange)
            socket = await open_byte_stream(stream, head, body["model"]) if head["stream"] else None
        except APIError as unavailable:
            if unavailable.status != 503:
                raise
            if unavailable.code in REPLICA_FAILURES:
                router.states.suspect()
            forwarded = await router._fail_over(request, family.route, body, caller, exchange, unavailable)
            if forwarded is None:
                raise
            return forwarded
    limits[REGION_HEADER] = router.region
    if not head["stream"]:
        if keep is not None and head["status"] == 200:
            with exchange.failures_recorded():  # a client gone meanwhile is still accounted for
                await keep(head["body"])
        return json_response(head, exchange, limits)
    client_wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    on_trailer = (lambda trailer: keep(trailer.get("response"))) if keep is not None else None
    events = relay_events(
        stream, socket, exchange, client_wants_usage=client_wants_usage, dialect=family.dialect, on_trailer=on_trailer
    )
    return RelayedStream(
        events, media_type="text/event-stream", headers=limits,
        on_end=lambda: abandon_unrelayed(stream, socket, exchange),
    )


def check_completion_budget(body: dict[str, Any], cap: int) -> None:
    """A completion budget over the model's context could never be served: 400, not a 429
    (its rate-limit cost) or the engine's refusal after a trip to the replica."""
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        if (budget := body.get(field)) is not None and budget > cap:
            raise APIError(
                400,
                f"{field} is {budget}, more than the model's context of {cap} tokens (prompt included)",
                param=field,
                code="context_length_exceeded",
            )
