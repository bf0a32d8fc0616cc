"""One inference request inside the router: what the pipeline's stages learn about it, and the one
way it ends.

Every request ends through ``Context.settle(outcome)``, exactly once, whatever happened:

- ``served``: the engine answered (a JSON body, or a stream to its end; the status may be an
  error the engine reported, a 400, or a stream's error event);
- ``refused``: the router (or this region) said no before any engine answered: 4xx, or 503;
- ``abandoned``: the client left. If the replica was already at work, the router hangs up the
  byte socket, the replica stops the engine and still sends the tokens generated; the request is
  closed when they come (in the background, ``LAST_ITEM_WAIT_S`` at most);
- ``failed``: our own fault (500), or a stream that broke;
- ``forwarded``: a peer region answered, to the end of its response; the peer bills it.

Settling releases the model slot, closes the spans and metrics (``telemetry/request.py``), writes
the usage record of an admitted request this region served (or the row of a peer's stream it
continued: ``resume.Continuation``), and lets go of its budget reservation. Nothing else in the
router ends a request.
"""

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fastapi import Request

from serve_app.auth.principal import Principal
from serve_app.engine.rendered import REFUSED_AFTER_RENDERING
from serve_app.errors import APIError
from serve_app.router.call import ReplicaCall
from serve_app.router.services import Services
from serve_app.surfaces import Surface
from serve_app.telemetry.logs import module_logger
from serve_app.telemetry.request import RequestTelemetry
from serve_app.wire.messages import Answer, Generated, Resume, Trailer

logger = module_logger(__name__)

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the response ended
SERVED, REFUSED, ABANDONED, FAILED, FORWARDED = "served", "refused", "abandoned", "failed", "forwarded"


class Outcome(NamedTuple):
    kind: str
    status: int
    code: str | None = None


def served(status: int, code: str | None = None) -> Outcome:
    return Outcome(SERVED, status, code)


def refused(err: APIError) -> Outcome:
    return Outcome(REFUSED, err.status, err.code)


def abandoned() -> Outcome:
    return Outcome(ABANDONED, CLIENT_CLOSED, "client_closed")


def failed(status: int = 500, code: str = "internal") -> Outcome:
    return Outcome(FAILED, status, code)


def forwarded(status: int, code: str | None = None) -> Outcome:
    return Outcome(FORWARDED, status, code)


# How long a request whose client left during its response's store write waits for the write
# before its record is written without the stored bytes (the write's statements have their own
# timeouts; this bounds its wait for one of the store's threads).
STORE_WAIT_S = 30.0
# How long a counting request (tokenize, count_tokens) whose client left waits for the replica's
# count, its real charge, before it is charged its estimate (a count takes milliseconds).
COUNT_WAIT_S = 10.0
_settling: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


async def wait_settled() -> None:
    """Until every abandoned request's last item is in (or given up on), and every charge of one
    is counted (``in_background``): before the router stops, so their usage records are queued
    while the ledger can still write them. Work such a task starts meanwhile is waited for too."""
    while pending := [task for task in _settling if not task.done()]:
        await asyncio.gather(*pending, return_exceptions=True)


def _taken(call: Any) -> bool:
    """A replica took the call: its head came, and was not a 5xx answer (a replica whose engine
    was dead answers 503 ``engine_unavailable`` as its head, no engine request started). A
    peer's resumed stream has no head of its own."""
    head = getattr(call, "head", None) if call is not None else None
    return head is not None and not (isinstance(head, Answer) and head.status >= 500)


def _peer_tokens(in_peer: Generated | None, record: Any) -> int:
    """What a peer's continuation adds to the request's tokens, for its rate limit here: what it
    generated, and the prompt when no engine here counted it (the peer's record bills it then)."""
    if in_peer is None:
        return 0
    return in_peer.completion_tokens + (in_peer.prompt_tokens if record.prompt_tokens == 0 else 0)


def in_background(work) -> None:
    """Run ``work`` on a task of its own (the request's is being cancelled), which ``wait_settled``
    waits for."""
    task = asyncio.get_running_loop().create_task(work)
    _settling.add(task)
    task.add_done_callback(_settling.discard)


@dataclass(frozen=True)
class Finishing:
    """Work a request's client left during, whose result its record needs (``even_if_left``)."""

    work: asyncio.Future
    apply: Callable[[Any], None]  # the result onto the request (``Context.note_stored``, ...)
    wait_s: float  # how long the record waits for it


async def even_if_left(ctx: "Context", work: Awaitable[Any], apply: Callable[[Any], None], wait_s: float) -> Any:
    """``work``'s result. A client that leaves meanwhile does not stop it: the request's own task
    ends at once, and its record, written in the background as it settles, waits up to ``wait_s``
    for ``apply`` to put the result on it (a stored response's size, a count's tokens)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        ctx.finishing = Finishing(task, apply, wait_s)
        raise


@dataclass(eq=False)
class Context:
    surface: Surface
    request: Request
    services: Services
    telemetry: RequestTelemetry
    # The request's id: its usage record's (written once, however often replayed) and its engine
    # request's, so a record, a log line and an engine request name the same request.
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    origin: str | None = None  # the region that forwarded this request here, if one did
    caller: Principal | None = None
    raw: bytes = b""
    body: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    previous_response_id: str | None = None  # Responses: the stored response it continues
    client_input: Any = None  # Responses: the input as the client sent it (before its history)
    history_bytes: int = 0  # Responses: the stored conversation's size (it is prompt too)
    price: Any = None  # what it may cost (``pricing.Price``), charged when it is admitted
    size_param: str = "max_tokens"  # the field a price over its tier's minute names (``Surface.size_param``)
    reservation: Any = None  # its price held against the key's token budget (``budgets.Reservation``)
    headers: dict[str, str] = field(default_factory=dict)  # rate limits, budgets, region: on the response
    admitted: bool = False  # passed the budget and the rate limit: its usage is recorded
    billed_elsewhere: bool = False  # forwarded: the peer that serves it records it
    admission_returned: bool = False  # its tokens/min and budget hold went back early (``hand_over``)
    call: ReplicaCall | None = None
    replica_took: bool = False  # a call replaced since (``replace_call``) had its replica's head
    cache_salt: str | None = None  # the owner's prefix-cache partition, for every call it makes
    session: str | None = None  # the conversation it continues (``routing.session_key``), for every call
    resumer: Any = None  # a stream's resumes (``resume.Resumer``), once its first call is open
    taken_over: Resume | None = None  # a stream a peer region's router asked this one to continue
    # ...whose limit that router had set itself (the client set none): the replica may lower it.
    taken_over_limit_lowerable: bool = False
    continuation: Any = None  # ...and its engine's part this region records (``resume.Continuation``)
    keep: Any = None  # Responses: stores the finished response (``responses.ResponsesAPI``)
    stored_bytes: int = 0  # what keeping it stored, in its owner's usage
    finishing: "Finishing | None" = None  # work its client left during, whose result the record needs
    counted_tokens: int = 0  # a counting surface's answer: the tokens the engine really counted
    generated: Generated | None = None
    # What a peer region's continuation of the stream generated, which that region records
    # (``PeerCall.recorded_there``): in the client's usage, not in this region's record.
    in_peer: Generated | None = None
    outcome: Outcome | None = None
    _release_slot: Any = None

    @classmethod
    def begin(cls, surface: Surface, request: Request, services: Services) -> "Context":
        """Call first thing when the request arrives: the clock and the SERVER span start here."""
        telemetry = RequestTelemetry(surface.route, request.headers, region=services.region, replica=services.replica)
        return cls(surface, request, services, telemetry)  # ``origin``: set once a peer's router is known

    @property
    def record(self):
        return self.telemetry.record

    def hold_slot(self) -> None:
        """Count the request in the model's in-flight load until it settles (or fails over)."""
        self._release_slot = self.services.in_flight.begin(self.model)

    def release_slot(self) -> None:
        if self._release_slot is not None:
            release, self._release_slot = self._release_slot, None
            release()

    def note_trailer(self, trailer: Trailer | None) -> None:
        """A call's report. A resumed stream's continuations add what they generated; the
        customer's prompt, and its cached part, are the first call's (a continuation's prefill is
        recorded apart) — or, when the first died before its first output (no prompt counted, no
        token to continue from), the continuation's, which ran that prompt alone."""
        if trailer is None:
            return
        if getattr(self.call, "recorded_there", False):  # a peer's continuation, which it records
            self.in_peer = trailer.generated
            first = self.generated
            cached = first.cached_tokens if first is not None and first.prompt_tokens else None
            self.telemetry.note_trailer(trailer, cached_tokens=cached)
            return
        if self.resumer is not None:
            self.resumer.note_attempt(trailer)
        first = self.generated
        if first is None or self.resumer is None or not self.resumer.done:
            self.generated = trailer.generated
        else:
            if first.prompt_tokens == 0:
                first = Generated(trailer.generated.prompt_tokens, first.completion_tokens,
                                  trailer.generated.cached_tokens)
            self.generated = Generated(first.prompt_tokens,
                                       first.completion_tokens + trailer.generated.completion_tokens,
                                       first.cached_tokens)
        self.telemetry.note_trailer(trailer, cached_tokens=self.generated.cached_tokens,
                                    engine_ms=getattr(self.call, "since_head_ms", None))

    # --- the one exit --------------------------------------------------------------------------
    def settle(self, outcome: Outcome) -> None:
        """End the request with ``outcome``; only the first call counts."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.telemetry.finish(outcome.status, outcome.code)  # the server clock stops now
        if self.call is not None and self.call.under_way:
            # The client left, or the stream broke: the replica stops the engine on the hang-up
            # and still sends the tokens it generated, which this request is billed.
            self.call.hang_up()
            in_background(self._close_when_last_item_is_in())
            return
        if self.finishing is not None:  # done already too: its result came as the client left
            in_background(self._close_when_finished())
            return
        self._close()

    async def _close_when_finished(self) -> None:
        """The work its client left during (``even_if_left``) goes on; the record takes its result
        once it is done, or is written without it past the work's bound (the work is cancelled)."""
        work, apply, wait_s = self.finishing.work, self.finishing.apply, self.finishing.wait_s
        try:
            done, _ = await asyncio.wait({work}, timeout=wait_s)
            if not done:
                work.cancel()
            elif not work.cancelled() and work.exception() is None:  # an error is the work's own to log
                apply(work.result())
        finally:
            self._close()

    def note_stored(self, stored_bytes: int) -> None:
        self.stored_bytes = stored_bytes

    def note_counted(self, answer: Any) -> None:
        """A counting surface's answer: the tokens the engine really counted, reconciled with the
        estimate it was charged as the request settles."""
        counts = self.surface.counts
        if counts is not None and isinstance(answer, Answer) and answer.status == 200:
            if isinstance(counted := answer.body.get(counts), int):
                self.counted_tokens = counted

    async def _close_when_last_item_is_in(self) -> None:
        try:
            self.note_trailer(await self.call.last())
        finally:
            self._close()

    def replace_call(self, call: Any) -> None:
        """``call`` in place of ``self.call`` (a resume's, or None: failing over). Whether a
        replica had taken the request is kept: its engine may have worked (``_not_served_here``)."""
        self.replica_took = self.replica_took or _taken(self.call)
        self.call = call

    def hand_over(self) -> None:
        """A peer region took it, and charges its own limits and holds its own budget: this
        region's admission goes back now, not at the answer's last byte (a ten-minute stream held
        its price against the key's budget here that long, on top of the peer's record once
        written, and this region's tokens/min short by it: the key's requests here were refused
        as over budget)."""
        self.billed_elsewhere = True
        if self.admitted and not self.admission_returned:
            self.services.auth.refund(self.caller, self.price.total)
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None
        self.admission_returned = True

    def _not_served_here(self, outcome: Outcome) -> bool:
        """A peer region served it (and charges its own limits), the engine refused it (a 4xx with
        no count: nothing ran, as a refusal of the router's own), or the gateway failed it (5xx)
        before any replica took it (no head: loading, overloaded, the replica gone): its
        admission's tokens go back (``Authenticator.refund``). Once a replica has taken it, its
        engine may have worked — a non-stream answer that failed reports no count, a stream cut
        off by a replica that died none either — so nothing goes back, also when the call was
        replaced since (failing over to peers that all refused, a resume that broke)."""
        if self.billed_elsewhere:
            return True
        if 400 <= outcome.status < 500 and outcome.status != CLIENT_CLOSED and self.generated is None:
            return True  # the engine refused it as the client's mistake, before it generated or counted a token
        taken = self.replica_took or _taken(self.call)
        return outcome.status >= 500 and not taken and self.record.first_chunk_ms is None

    def _refundable(self, outcome: Outcome) -> int:
        """What of the price goes back for a request not served here: all of it, but for a prompt
        the engine refused as longer than the context, or embeddings' inputs over the request's
        cap: the replica every tenant shares rendered it whole (up to the tier's body size:
        megabytes), and tokenized it unless it was longer in characters than the context already,
        so the prompt's estimate stays charged (a request each was the whole cost: at 600 a
        minute, a replica's front end working for nobody)."""
        if not self.billed_elsewhere and outcome.code in REFUSED_AFTER_RENDERING and outcome.status == 400:
            return self.price.completion_tokens
        return self.price.total

    def _close(self) -> None:
        outcome = self.outcome
        self.release_slot()
        self.record.forwarded_by = self.origin
        self.telemetry.close(outcome.status, outcome.code)
        if self.admitted and not self.billed_elsewhere and self.surface.billed:
            resumer = self.resumer
            record = self.services.meter.record(
                self.id, self.caller, self.record, self.generated, origin=self.origin, stored_bytes=self.stored_bytes,
                resumes=resumer.done if resumer else 0, resume_prompt_tokens=resumer.prompt_tokens if resumer else 0,
                peer_part=self.in_peer is not None,
            )
            if record is not None:  # its real cost beyond its price (the prompt estimate's miss)
                self.services.auth.charge(self.caller, record.total_tokens + _peer_tokens(self.in_peer, record)
                                          - self.price.total)
        elif self.continuation is not None and self.surface.billed and self.generated is not None:
            self.services.meter.record_continuation(
                self.continuation, self.caller, self.record, self.generated, origin=self.origin,
                prompt_counted_there=self.taken_over.cached_tokens is not None,
                tail=len(self.taken_over.token_ids),
            )
        elif self.admitted and self.counted_tokens:  # counting tokens: not billed, but rate-limited
            self.services.auth.charge(self.caller, self.counted_tokens - self.price.total)
        if self.admitted and not self.admission_returned and self._not_served_here(outcome):
            self.services.auth.refund(self.caller, self._refundable(outcome))
        if self.reservation is not None:  # after the record: its real tokens count from now on
            self.reservation.release()
