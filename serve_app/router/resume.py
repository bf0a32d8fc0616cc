"""Resuming a stream whose engine failed after some output, on another replica of the region, so
that the client sees one uninterrupted answer.

When a stream's trailer says its engine failed (``engine_unavailable``, the replica alive to say
so) and carries the tokens the engine had generated, the router calls the model again with the
same request and a ``wire.Resume``: the new replica renders the same prompt, appends those tokens
(``engine/rendered.py``), and the engine continues exactly where the first one stopped — its next
token is the one the first engine would have generated next. Before it, the replica replays those
tokens through its serving layer (``engine/replay.py``), so its parsers stand where the first
stream's stood — a stream resumes in the middle of reasoning or of a tool call's arguments as
well as of plain text — and cuts out what the client already has (``surfaces/seam.py``, which
also counts, here, what the client has from the bytes relayed; for Responses, with the client's
item ids and event numbering). Its usage is the client's one request, its limit what was left of
the request's. The chunks keep the stream's id (the router's request id names both engine
requests).

Bounded: ``router.max_resumes`` per stream (1 by default), each within ``router.resume_window_s``
of the failure. The region's other replicas are tried first, for ``router.resume_here_s``
(replicas that answer ``engine_unavailable`` meanwhile are tried again: Serve stops routing to a
dead replica once its health check fails, within a few seconds) — unless the failed replica is the
only one the region runs, whose replacement takes an engine start; then a peer region's router,
as failover does: the request goes with a token for that peer alone and the tokens generated so
far (``RESUME_FIELD``); the peer runs it as a resume on one of its replicas, does not store it
or admit it again, and sends the stream back with its usage in its closing (``peer_call.py``).
This router records the one request, with what this region's engines did, and stores a Responses
answer; the peer records what its engine did in a row that ``continues`` that record (a request's
tokens, not a request: docs/usage.md), exact also when the stream is cut before its ending.

Not resumed (the stream ends with the engine-failure event, as before, and is billed what was
generated): a replica that vanished with no trailer (no tokens to continue from), more than one
choice or prompt, guided decoding (``response_format``, a Responses ``text.format``, vLLM's
structured outputs, a tool choice that forces a call: the grammar would restart at the seam),
logprobs (the replay has none to send), completions' ``echo``, a Responses request in the
background or with a built-in tool (vLLM's own loop of engine calls), presence or frequency
penalties and a ``seed`` (they would start again at the seam), ``return_token_ids``;
docs/reliability.md. ``min_tokens`` goes on counting: the continuation is asked for what is left.
"""

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from serve_app.errors import APIError
from serve_app.router import pricing
from serve_app.router.call import REPLICA_FAILURES, ReplicaCall
from serve_app.router.peer_call import PeerCall
from serve_app.surfaces import seam
from serve_app.telemetry.logs import module_logger
from serve_app.wire.messages import ENGINE_UNAVAILABLE, Call, Resume, StreamOpen, Trailer

logger = module_logger(__name__)

# Fields that make a continuation unfaithful: a grammar restarts at the seam, or per-token extras
# the replay cannot send again.
_UNRESUMABLE_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "logprobs", "top_logprobs", "prompt_logprobs", "echo", "best_of",
    # vLLM's presence and frequency penalties count the output only, which a continuation's tail
    # is not (it is prompt): the answer would go on as if nothing had been said.
    "presence_penalty", "frequency_penalty",
    "return_token_ids",  # a chunk the seam shortens would keep all its ids: some sent twice
)
# Tool choices that leave the model free (any other forces a call through guided decoding).
_FREE_TOOL_CHOICES = (None, "auto", "none")
RETRY_S = 0.2  # between tries of a replica that answered engine_unavailable
# The body field in which a router hands a peer region's router the stream it continues.
RESUME_FIELD = "polargrid_resume"  # the product's name: a "pg_" field would read as PostgreSQL


@dataclass(frozen=True)
class Continuation:
    """A peer's stream this region continues and records its engine's part of (the sender asked)."""

    record_id: str  # this region's row: made when the request arrived, as every record's id
    continues: str  # the sender's record (its request id)
    started_at_ms: int | None  # when the sender admitted the request: the row's day is the request's


def resumable(surface: str, body: dict[str, Any]) -> bool:
    """Whether a stream of ``body`` can be resumed faithfully (the module's docstring says why not)."""
    if surface not in seam.SURFACES or body.get("stream") is not True:
        return False
    if (body.get("n") or 1) != 1 or (surface == "completions" and pricing.prompt_count(body) != 1):
        return False
    if any(_set(field, body.get(field)) for field in _UNRESUMABLE_FIELDS):
        return False
    if body.get("seed") is not None:  # a fresh generator after the seam: not the seeded answer (0 is a seed)
        return False
    if surface == "responses" and not _responses_resumable(body):
        return False
    # Messages' structured output (vLLM makes it a response_format: its grammar would restart).
    output_config = body.get("output_config")
    if surface == "messages" and isinstance(output_config, dict) and output_config.get("format") is not None:
        return False
    choice = body.get("tool_choice")
    return (choice.get("type") if isinstance(choice, dict) else choice) in _FREE_TOOL_CHOICES


def _set(field: str, value: Any) -> bool:
    """Whether ``field`` asks for something a continuation cannot give. ``logprobs: 0`` does on
    completions (the sampled token's logprob; 0 is not "off", nor is it False), and
    ``response_format: {"type": "text"}`` does not (no grammar)."""
    if value is None or value is False or value == []:
        return False
    if field == "response_format" and isinstance(value, dict) and value.get("type") == "text":
        return False
    return not (value == 0 and field not in ("logprobs", "prompt_logprobs"))


def _responses_resumable(body: dict[str, Any]) -> bool:
    """A Responses stream: no structured output, no logprobs, no background run, and only
    function tools (a built-in tool's turns are vLLM's own loop of engine calls)."""
    text_format = ((body.get("text") or {}).get("format") or {}).get("type")
    if text_format not in (None, "text") or body.get("background"):
        return False
    if "message.output_text.logprobs" in (body.get("include") or ()):
        return False
    return all(isinstance(tool, dict) and tool.get("type") == "function" for tool in body.get("tools") or ())


def taken_over(ctx) -> Resume | None:
    """The resume a peer region's router sent with the request (``RESUME_FIELD``), taken out of
    the body: this region continues a stream whose engine failed there, which that region admitted
    and records (this one records its engine's part, when asked: ``Continuation``).
    Only a peer's router can send one (its failover token, for this region alone, and the hop
    header); from anyone else the field is a 400."""
    sent = ctx.body.pop(RESUME_FIELD, None)
    if sent is None:
        return None
    if ctx.origin is None or not ctx.caller.peer_bound:
        raise APIError(400, f"{RESUME_FIELD} is set by a peer region's router only", param=RESUME_FIELD,
                       code="unknown_parameter")
    sent = sent if isinstance(sent, dict) else {}
    ids, received, request_id = sent.get("token_ids"), sent.get("received"), sent.get("request_id")
    item_ids, previous = sent.get("ids", {}), sent.get("previous_response_id")
    cached = sent.get("cached_tokens")  # None: the continuation's own count (a peer one release behind)
    created = sent.get("created")  # None: a peer one release behind, or not chat or completions
    if received is None and isinstance(sent.get("text"), str):  # a peer one release behind
        received = {"content": len(sent["text"]), "opening": int(sent.get("opened", True))}
        received = {channel: n for channel, n in received.items() if n}
    if not (isinstance(ids, list) and all(type(i) is int and 0 <= i < 2**31 for i in ids)
            and seam.valid_received(received) and seam.valid_ids(item_ids)
            and isinstance(request_id, str) and 0 < len(request_id) <= 64
            and (cached is None or (type(cached) is int and 0 <= cached < 2**31))
            and (created is None or (type(created) is int and 0 <= created < 2**40))
            and (previous is None or (isinstance(previous, str) and len(previous) <= 128))):
        raise APIError(400, f"{RESUME_FIELD} needs token_ids, received and request_id", param=RESUME_FIELD)
    if sent.get("record_continuation") is True:  # a peer one release behind bills it all itself
        started = sent.get("started_at_ms")
        started = started if type(started) is int and 0 <= started < 2**45 else None
        ctx.continuation = Continuation(ctx.id, request_id, started)
    ctx.id = request_id  # the engine request's: the chunks keep the stream's id
    ctx.previous_response_id = previous  # Responses: the id the answer echoes (the sender recalled it)
    ctx.taken_over_limit_lowerable = sent.get("limit_set_by_router") is True
    return Resume(tuple(ids), received, item_ids, cached, created)


class Resumer:
    """One stream's resumes: how many are left, and the tokens generated before each seam."""

    def __init__(self, ctx, *, max_resumes: int, window_s: float, here_s: float):
        self.ctx = ctx
        # A continuation a peer sent is not resumed again: the region that sent it holds the bill.
        self.left = max_resumes if resumable(ctx.surface.name, ctx.body) and ctx.taken_over is None else 0
        self.window_s = window_s
        self.here_s = here_s
        self.done = 0  # resumes that took
        self.prompt_tokens = 0  # what the continuations prefilled (recorded apart from the prompt)

    @property
    def keeps_bytes(self) -> bool:
        """Whether the relay keeps what it relayed (a resume reads the client's text from it)."""
        return self.left > 0

    async def resume(self, broken: Trailer, relayed: bytes) -> bool:
        """Continue the stream on a replica of the region, or else of a peer region: True when the
        new call's stream is open (``ctx.call`` is it), False when this stream cannot or could not
        be resumed."""
        ctx = self.ctx
        if broken.error_code != ENGINE_UNAVAILABLE:
            return False
        # None: the replica (or a peer's continuation) could not say what was generated; () is
        # none yet: the continuation is the whole answer, which the client has not seen a token of.
        field = ctx.surface.limit.field if self.left > 0 and broken.token_ids is not None else None
        remaining = ctx.body[field] - len(broken.token_ids) if field else 0
        if remaining < 1:  # not resumable, resumed enough, or nothing left to say
            ctx.telemetry.note_not_resumed()
            return False
        self.left -= 1
        started = time.perf_counter()
        surface = ctx.surface.name
        # The customer's cached prompt tokens, once a call counted its prompt (none did when the
        # engine died before the first output: the continuation's own count is then the one).
        counted = ctx.generated if ctx.generated is not None and ctx.generated.prompt_tokens else None
        resume = Resume(tuple(broken.token_ids), seam.received(surface, relayed),
                        seam.item_ids(relayed) if surface == "responses" else {},
                        counted.cached_tokens if counted is not None else None, seam.created(surface, relayed))
        body = {**ctx.body, field: remaining}
        if isinstance(min_tokens := body.get("min_tokens"), int):  # counted from the continuation's start
            body["min_tokens"] = max(0, min_tokens - len(broken.token_ids))
        if surface == "messages" and (body.get("thinking") or {}).get("type") == "enabled":
            # Its budget must stay under max_tokens, which is now what is left; vLLM does not
            # enforce the budget (its thinking_token_budget is None either way): adaptive keeps
            # the thinking on with no budget to refuse.
            body["thinking"] = {"type": "adaptive"}
        span = ctx.telemetry.start_resume("engine_unavailable", len(resume.token_ids))
        call = peer = None
        try:
            call = None if self._none_other_here(broken) else await self._open_here(Call(
                # A limit the router set from its estimate may be lowered by the replica to the
                # context the real prompt (and the tokens before the seam) leaves, as the first was.
                body, ctx.id, limit_set_by_router=ctx.price.limit_set_by_router, cache_salt=ctx.cache_salt,
                resume=resume, avoid_replica=broken.replica, previous_response_id=ctx.previous_response_id,
                # Its session's pin moves with it: the failed replica's engine is gone, and this
                # one now holds the conversation (its next turn went back to it until Serve dropped it).
                session=ctx.session,
            ), deadline=started + min(self.window_s, self.here_s))
            if call is None:
                call = await self._open_in_peer(body, resume, span)
                peer = call.region if call is not None else None
        finally:
            ctx.telemetry.end_resume(span, call is not None, peer)
        if call is None:
            return False
        ctx.replace_call(call)
        self.done += 1
        # The request's own id first: a caller chooses its trace id (traceparent), and may reuse it.
        logger.info("stream %s (trace %s) resumed after %d tokens%s", ctx.id, ctx.telemetry.trace_id,
                    len(resume.token_ids), f" in {peer}" if peer else "")
        return True

    def _none_other_here(self, broken: Trailer) -> bool:
        """The failed replica is the only one Serve lists here: every call would go back to it
        until Serve replaces it (an engine start, longer than the window), so a peer goes first."""
        services = self.ctx.services
        return broken.replica is not None and services.states.get(self.ctx.model).running <= 1

    def note_attempt(self, trailer: Trailer) -> None:
        """A continuation's trailer: its prefill was the resumed prompt."""
        if self.done:
            self.prompt_tokens += trailer.generated.prompt_tokens

    async def _open_here(self, call: Call, *, deadline: float) -> ReplicaCall | None:
        """A replica's open stream for ``call``, trying again while replicas answer that their
        engine died, until ``deadline``; None if none took it (or the model has no replica left
        here: Serve then queues a call until one is back, which may be minutes)."""
        ctx = self.ctx
        services = ctx.services
        while (left := deadline - time.perf_counter()) > 0:
            await services.states.ensure_fresh()
            try:
                services.states.require_serving(ctx.model, services.region)
            except APIError:
                return None
            replica_call = services.replica_call(ctx.model, ctx.surface.name, call)
            try:
                head = await asyncio.wait_for(replica_call.first(), left)
            except asyncio.TimeoutError:
                return None
            except APIError as unavailable:
                if unavailable.code in REPLICA_FAILURES:
                    services.states.suspect()
                if unavailable.status != 503:
                    return None
                await asyncio.sleep(min(RETRY_S, max(0.0, deadline - time.perf_counter())))
                continue
            if isinstance(head, StreamOpen):
                return replica_call
            logger.warning("a resumed stream was answered %s: %s", head.status, json.dumps(head.body)[:200])
            return None
        return None

    async def _open_in_peer(self, body: dict[str, Any], resume: Resume, span) -> PeerCall | None:
        """The continuation's stream from the first peer region whose router takes it (one hop:
        never for a request a peer forwarded here), or None."""
        ctx = self.ctx
        services, caller = ctx.services, ctx.caller
        peers = [p.region for p in services.forwarder.peers
                 if p.region != services.region and caller.allows_region(p.region)]
        if ctx.origin is not None or not peers:
            return None
        # The peer reports the usage in its closing (the client's, for the whole answer); a Messages
        # or Responses stream always carries it (message_delta, the terminal response). It records
        # what its engine did itself (``record_continuation``), from its engine's own count.
        surface = ctx.surface.name
        sent = {**body, RESUME_FIELD: {"token_ids": list(resume.token_ids), "received": resume.received,
                                       "ids": resume.ids, "request_id": ctx.id,
                                       "cached_tokens": resume.cached_tokens, "created": resume.created,
                                       "previous_response_id": ctx.previous_response_id,
                                       "limit_set_by_router": ctx.price.limit_set_by_router,  # lowerable, as here
                                       "record_continuation": True,
                                       "started_at_ms": ctx.record.start_ns // 1_000_000}}
        if surface in ("chat", "completions"):
            sent["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        bound = await asyncio.to_thread(
            lambda: {region: f"Bearer {services.auth.forwarding_token(caller, region)}" for region in peers}
        )
        peer, upstream, attempts = await services.forwarder.open(
            ctx.surface.route, sent, ctx.telemetry.resume_propagation(span),
            allowed=bound.__contains__, authorization=bound.__getitem__,  # the peers it minted for
        )
        if upstream is None:
            logger.warning("no peer region resumed stream %s (trace %s): %s", ctx.id, ctx.telemetry.trace_id,
                           [(a.region, a.outcome, a.status) for a in attempts])
            return None
        if upstream.status_code != 200:
            detail = (await upstream.aread())[:200]
            await upstream.aclose()
            logger.warning("%s refused to resume stream %s (trace %s): %s %s", peer.region, ctx.id,
                           ctx.telemetry.trace_id, upstream.status_code, detail)
            return None
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return PeerCall(peer.region, upstream, tokens_before=len(resume.token_ids), surface=surface,
                        client_wants_usage=wants_usage)
