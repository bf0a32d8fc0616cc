"""The router's way for every request that runs on a model replica, as named stages over one
``Context`` (``context.py``), in the order they run:

    authenticate  the credential (401/403) — and, before the body is read, a key already over its
                  request limit (429) or a body larger than its tier allows (400)
    parse         the body: size (413), JSON (400 invalid_json)
    resolve       the model name → the canonical id served here (404)
    authorize     the caller's model scope (403), before anything else is said of the model
                  (its task, its context, its vectors' size)
    validate      the surface's strict body model (400 naming the field), and a model that
                  does the surface's task (400: an embedding model does not chat)
    recall        Responses: the stored conversation ``previous_response_id`` continues (404)
    price         what the request may cost: prompt plus the completion the engine will obey
    admit         the key's token budget and rate limit (429 + Retry-After)
    route         the model is loaded here (503) — and holds one of its slots
    call          the replica's answer: a whole body, a stream's socket, or a request under way
    relay         the answer to the client, and the surface's closing (``relay.py``)

and the request ends through ``Context.settle``, once. Telemetry wraps the stages (``run``'s
loop, ``RequestTelemetry.stage``): it times them and reads what each learned off the context; no
stage calls it. A 503 from ``route`` or ``call`` (not loaded, overloaded, replica or engine dead)
goes to one peer region first (``fail_over``). What
differs between surfaces is their row in ``serve_app/surfaces``; nothing here names one.
"""

import asyncio

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from serve_app import routing
from serve_app.errors import APIError, retry_later
from serve_app.router import isolation, pricing, relay
from serve_app.router.body import declared_length, read_body
from serve_app.router.call import REPLICA_FAILURES
from serve_app.router.context import (
    CLIENT_CLOSED, COUNT_WAIT_S, Context, abandoned, even_if_left, failed, forwarded, in_background, refused,
)
from serve_app.router.failover import CONTINUATION_RECORDED_HEADER, HOP_HEADER, REGION_HEADER
from serve_app.router.embeddings_schema import beyond_the_model
from serve_app.router.media import media_problem
from serve_app.router.request_schema import parse_json_object, validate_body
from serve_app.router.resume import Resumer, taken_over
from serve_app.router.services import Services
from serve_app.surfaces import Surface
from serve_app.telemetry.logs import module_logger
from serve_app.telemetry.request import TRACE_ID_HEADER
from serve_app.wire.messages import Accepted, Call, Head, StreamOpen

logger = module_logger(__name__)


async def run(services: Services, request: Request, surface: Surface) -> Response:
    """Serve one request of ``surface``; every error is in the surface's own dialect."""
    ctx = Context.begin(surface, request, services)
    stage = None
    try:
        for stage in STAGES:
            with ctx.telemetry.stage(stage.__name__, ctx):  # the stages never call telemetry
                await stage(ctx)
        stage = None
        response = await dispatch(ctx)
    except APIError as err:
        ctx.settle(refused(err))
        if stage in CHARGED_WHEN_REFUSED and not ctx.caller.peer_bound:  # a peer's: admitted where it came from
            await _charge_refusal(ctx)  # after settling: a client that leaves meanwhile leaves it settled
        refusal = surface.dialect.error_response(err)
        # Its timing (all network) and trace id; a credential refused gets no timing: whether its
        # key's row was cached (µs) or read (ms) would say whether someone used that key lately.
        refusal.headers.update(ctx.telemetry.trace_headers() if stage is authenticate else ctx.telemetry.headers())
        return refusal
    except asyncio.CancelledError:  # the client left before an answer was ready
        ctx.settle(abandoned())
        if stage in CHARGED_WHEN_REFUSED and not ctx.caller.peer_bound:
            # The lookup was under way: a client that leaves during it still pays its request
            # (else leaving at once would buy registry reads past the key's requests/min). This
            # task is being cancelled: the charge runs on its own.
            in_background(_charge_refusal(ctx))
        raise
    except ClientDisconnect:  # the client left while sending its body: its mistake, nobody to answer
        ctx.settle(abandoned())
        if stage in CHARGED_WHEN_REFUSED and not ctx.caller.peer_bound:  # its read cost the router, as a refusal's
            in_background(_charge_refusal(ctx))
        return Response(status_code=CLIENT_CLOSED)
    except Exception:
        # Our own fault, answered here rather than by ingress's catch-all, which cannot know the
        # request: in the surface's dialect, with its trace id and timing, as every JSON answer.
        logger.exception("unhandled error in router, request %s (trace %s)", ctx.id, ctx.telemetry.trace_id)
        ctx.settle(failed())
        error = surface.dialect.error_response(APIError(500, "internal error; it has been logged", code="internal"))
        error.headers.update(ctx.telemetry.headers())
        return error
    return surface.dialect.reshape(response)


# --- the stages before the model --------------------------------------------------------------
async def authenticate(ctx: Context) -> None:
    ctx.caller = await ctx.services.caller(ctx.request, api_key_header=ctx.surface.dialect.api_key_header)
    if ctx.caller.peer_bound:
        # A peer's router (its failover token): its hop header names the origin (a peer router's
        # word, nobody else's: before this, and from any other caller, there is none), and nothing
        # is refused before the body is read — a stream it resumes here carries every token
        # generated so far (admitted there, billed there), and a request it forwards meets this
        # region's limits at admission.
        ctx.origin = ctx.request.headers.get(HOP_HEADER)
        return
    # What the limiter refuses for certain is refused before a byte of the body is read (a key
    # over its limit, a body its tier could never admit), so that it costs no parse.
    size = declared_length(ctx.request) or 0
    ctx.services.auth.refuse_early(ctx.caller, pricing.estimate_prompt_tokens(size), ctx.surface.prompt)


async def parse(ctx: Context) -> None:
    # A chunked body declares no size: its reading stops where its tier's minute of prompt ends
    # (a peer router's: at the size limit of every body, as ``authenticate`` says why).
    tier_bytes = ctx.services.auth.body_limit(ctx.caller, pricing.CHARS_PER_TOKEN)
    refuse_past = None if ctx.caller.peer_bound else (tier_bytes, _over_tier(ctx))
    ctx.raw = await read_body(ctx.request, refuse_past=refuse_past)
    ctx.body = parse_json_object(ctx.raw)
    ctx.taken_over = taken_over(ctx)  # a peer region's stream to continue (its router only)


async def resolve(ctx: Context) -> None:
    try:
        ctx.model = ctx.body["model"] = ctx.services.resolve(ctx.body.get("model"), ctx.caller)
    except APIError as err:
        if ctx.origin is None or err.code != "model_not_found":
            raise
        # Forwarded by a peer that serves the model (it resolved it) and could not: a model not
        # served here is no verdict on the request. A 503 moves the forwarder on to its next peer,
        # or to its own 503 (loading, with Retry-After), instead of a 404 that a client takes for
        # "this model does not exist" and never retries (a region's optional model starting
        # after a cluster rollout, where no peer serves it).
        raise retry_later(f"{ctx.body.get('model')!r} is not served in region {ctx.services.region}",
                          "model_not_served") from None


async def validate(ctx: Context) -> None:
    """The surface's strict body, the model's task, and the region's media policy: a media part
    the model's region does not take (or from a host it does not allow) is a 400 naming the part."""
    validate_body(ctx.surface.name, ctx.body)
    facts = ctx.services.models[ctx.model]
    if ctx.surface.task is not None and facts.task != ctx.surface.task:
        raise _wrong_task(ctx)
    if (problem := media_problem(ctx.surface.name, ctx.body, facts.media)) is not None:
        raise problem
    if ctx.surface.name == "embeddings" and (problem := beyond_the_model(
            ctx.body, context_len=facts.context_len, dimensions=facts.embedding_dimensions)) is not None:
        raise problem


async def authorize(ctx: Context) -> None:
    ctx.services.auth.authorize_model(ctx.caller, ctx.model)


async def recall(ctx: Context) -> None:
    """Responses: the router continues the stored conversation (the engine is stateless)."""
    if ctx.surface.stores and ctx.taken_over is not None:
        return  # a peer's continuation: its router recalled the conversation, and stores the answer
    if ctx.surface.stores:
        ctx.previous_response_id, ctx.client_input = ctx.body.get("previous_response_id"), ctx.body.get("input")
        ctx.keep, ctx.history_bytes = await ctx.services.responses.continue_from(ctx.body, ctx.caller)


async def price(ctx: Context) -> None:
    """The most the engine may generate for it, with the body normalised so that the engine obeys
    exactly the limit priced (``pricing.py``; 400 for a limit field the surface ignores)."""
    facts, size = ctx.services.models[ctx.model], len(ctx.raw) + ctx.history_bytes
    ctx.size_param = ctx.surface.size_param(ctx.body)  # as the client set it: pricing normalises the limit
    # A request without a limit gets the model's default, but never more, all its sequences
    # together, than its key's tier can ever admit in a minute: a free key's request without
    # max_tokens is served, not a 400.
    tier = ctx.services.auth.args.tiers.get(ctx.caller.tier)
    left = tier.tokens_per_minute - pricing.estimate_prompt_tokens(size) if tier is not None else None
    ctx.price = pricing.price(
        ctx.surface.name, ctx.body, size, context_len=facts.context_len,
        default_max_tokens=facts.default_max_tokens,  # None for a model that generates nothing
        default_total=left,
    )


async def admit(ctx: Context) -> None:
    """Its worst case held against the key's token budget (nothing held for a surface that is
    not billed, but a spent budget refuses it too), then charged to its rate limit."""
    services, caller = ctx.services, ctx.caller
    if ctx.taken_over is not None:  # the region that sent it admitted it, and records it
        ctx.headers = {REGION_HEADER: services.region}
        if ctx.continuation is not None:  # this one records its engine's part (the sender asked)
            ctx.headers[CONTINUATION_RECORDED_HEADER] = "1"
        ctx.body["priority"] = services.auth.priority(caller, ctx.body.get("priority"))
        return
    held = ctx.price.total if ctx.surface.billed else 0
    try:
        ctx.reservation = await services.meter.reserve(caller, held)  # 429 budget_exceeded
    except APIError:
        await services.auth.count_refused(caller)  # still one of its requests (see count_refused)
        raise
    # A request that set no limit is over its tier by its prompt alone (a stored conversation's
    # included): the router's limit, what the tier left, is already the least there is.
    by_prompt = ctx.price.limit_set_by_router
    limits = await services.auth.admit(  # 429 + Retry-After
        caller, ctx.price.total, ctx.surface.prompt if by_prompt else ctx.size_param,
        ctx.surface.generates and not by_prompt)
    ctx.headers = {**limits, **ctx.reservation.headers, REGION_HEADER: services.region}
    ctx.admitted = True
    if ctx.surface.billed:
        ctx.body["priority"] = services.auth.priority(caller, ctx.body.get("priority"))  # the tier's, or lower


STAGES = (authenticate, parse, resolve, authorize, validate, recall, price, admit)
# Every stage after the key is known: a request they refuse costs its key one request of its
# minute, as a refusal at admission does (docs/auth.md, "A refusal costs a request"). Each is
# router work — a parse of up to the tier's minute of prompt (~0.3 s of the event loop for 2 MiB
# of small objects), a Responses follow-up's stored conversation read from the key registry —
# and a key whose refusals were free could have it done without end: a bad body sent in a loop
# was never a 429.
CHARGED_WHEN_REFUSED = (parse, resolve, authorize, validate, recall, price)


async def _charge_refusal(ctx: Context) -> None:
    try:
        await ctx.services.auth.count_refused(ctx.caller)
    except Exception:  # the limiter itself refusing or unavailable: the request's own error stands
        logger.debug("could not charge a refused request to its key", exc_info=True)


def _wrong_task(ctx: Context) -> APIError:
    models = ctx.services.models
    served = [model for model in ctx.services.usable_by(ctx.caller) if models[model].task == ctx.surface.task]
    return APIError(
        400,
        f"{ctx.model} does not serve {ctx.surface.route}: it is a model of task {ctx.services.models[ctx.model].task!r}"
        f"; models of task {ctx.surface.task!r} here: {', '.join(served) or 'none'}",
        param="model", code="model_does_not_serve_route",
    )


def _over_tier(ctx: Context) -> APIError:
    return APIError(
        400,
        f"the request body is larger than tier {ctx.caller.tier} could admit in a minute of tokens; "
        f"shorten {ctx.surface.prompt} or split it across requests",
        param=ctx.surface.prompt, code="request_exceeds_tier_limit",
    )


# --- the model, here or in a peer region ------------------------------------------------------
async def dispatch(ctx: Context) -> Response:
    try:
        await route(ctx)
        with ctx.telemetry.stage("call", ctx):
            head = await call(ctx)
    except APIError as unavailable:
        if unavailable.status != 503:
            raise
        if unavailable.code in REPLICA_FAILURES:
            ctx.services.states.suspect()
        if (response := await fail_over(ctx, unavailable)) is None:
            raise
        return response
    if isinstance(head, StreamOpen):
        return relay.stream(ctx)
    return await relay.answer(ctx, head)


async def route(ctx: Context) -> None:
    states = ctx.services.states
    await states.ensure_fresh()
    states.require_serving(ctx.model, ctx.services.region)  # 503 unless loaded here
    ctx.hold_slot()


async def call(ctx: Context) -> Head:
    """The replica's answer: a whole body, or a stream's open socket. A non-stream request that is
    billed is under way first (``Accepted``): its socket is the hang-up line, its body follows."""
    services = ctx.services
    # The owner's prefix-cache partition: no tenant can hit, and so time, another's prompt.
    ctx.cache_salt = isolation.cache_salt(ctx.caller.owner) if ctx.surface.billed else None
    # The conversation it continues: the model's request router keeps it on one replica.
    ctx.session = routing.session_key(ctx.request.headers, ctx.body, ctx.previous_response_id)
    wire_call = Call(
        ctx.body, ctx.id, limit_set_by_router=ctx.price.limit_set_by_router or ctx.taken_over_limit_lowerable,
        previous_response_id=ctx.previous_response_id, cache_salt=ctx.cache_salt, resume=ctx.taken_over,
        session=ctx.session, encoded_answers=True,
    )
    ctx.call = services.replica_call(ctx.model, ctx.surface.name, wire_call)
    if ctx.surface.counts is not None:  # a count the client leaves before is still its charge
        head = await even_if_left(ctx, ctx.call.first(), ctx.note_counted, COUNT_WAIT_S)
    else:
        head = await ctx.call.first()
    if isinstance(head, Accepted):
        return await ctx.call.answer()
    if isinstance(head, StreamOpen):  # should its engine fail mid-stream, another replica resumes it
        ctx.resumer = Resumer(ctx, max_resumes=services.max_resumes, window_s=services.resume_window_s,
                              here_s=services.resume_here_s)
    return head


async def fail_over(ctx: Context, local: APIError) -> Response | None:
    """Forward to the first peer region that takes the request, or None (answer ``local``).

    One hop: a request that was itself forwarded is never forwarded again. The caller's own
    credential never leaves this region: each peer gets a token minted here for the same key and
    claims, whose audience is that peer alone and which lives a minute at most, so a peer (or
    anyone on the way) cannot replay it elsewhere or for long. The region that serves the request
    bills it: this one only if no peer took it.
    """
    services, caller = ctx.services, ctx.caller
    peers = [p.region for p in services.forwarder.peers if p.region != services.region and caller.allows_region(p.region)]
    if ctx.origin is not None or not peers:
        return None
    reason = local.code or "unavailable"
    ctx.release_slot()  # the local model is done with it
    ctx.replace_call(None)
    propagation = ctx.telemetry.start_failover(reason)
    try:
        # Minted up front in a thread: a key-store cache miss must not block the event loop.
        bound = await asyncio.to_thread(
            lambda: {region: f"Bearer {services.auth.forwarding_token(caller, region)}" for region in peers}
        )
        result = await services.forwarder.forward(
            # The peers tokens were minted for: a deploy meanwhile may have listed another one.
            ctx.surface.route, _as_the_client_set_it(ctx), propagation, reason=reason, allowed=bound.__contains__,
            on_done=lambda status, code: ctx.settle(forwarded(status, code)),  # a stream: its last byte
            authorization=bound.__getitem__, dialect=ctx.surface.dialect,
        )
    except asyncio.CancelledError:
        ctx.billed_elsewhere = True  # the client left meanwhile: a peer may have admitted it, and bills it
        raise
    # The region that took it bills it; none did: this one (any other error: no peer's engine ran it).
    ctx.telemetry.note_failover(result.attempts, result.region)
    if result.response is None:
        if result.attempts and result.attempts[-1].outcome == "no_head":
            # A peer had it and sent no answer's head: it may be running it, and records what its
            # engine did (until 2026-12-07 this region recorded its 503 too: two requests for one).
            ctx.billed_elsewhere = True
        return None
    ctx.hand_over()
    if not result.stream:
        ctx.settle(forwarded(result.status, result.error_type))
        # A peer's answer carries its trace id (the same trace) and its own timing; one made here
        # (the peer's body broke off: 502) gets this region's, as every JSON answer of ours does.
        if TRACE_ID_HEADER not in result.response.headers:
            result.response.headers.update(ctx.telemetry.headers())
    return result.response


def _as_the_client_set_it(ctx: Context) -> dict:
    """The body a peer region gets: as priced here, but without a completion limit this router
    set (the peer sets and prices its own, and may lower it to what the real prompt leaves), a
    limit the client set under the name it used (pricing renames chat's ``max_tokens``: the peer's
    errors must name the client's field), and a Responses follow-up as the client sent it,
    ``previous_response_id`` and its own input: the regions share the store, so the peer recalls
    the conversation itself and echoes the id."""
    body = ctx.body
    if ctx.previous_response_id is not None:
        body = {**body, "input": ctx.client_input, "previous_response_id": ctx.previous_response_id}
    if ctx.surface.limit is None:
        return body
    field = ctx.surface.limit.field
    if ctx.price.limit_set_by_router:
        return {key: value for key, value in body.items() if key != field}
    if ctx.size_param != field and field in body:
        return {ctx.size_param if key == field else key: value for key, value in body.items()}
    return body
