"""Usage metering on the router: a budget check before a request is admitted, and one usage record
when each admitted request that generates is over (ledger, budgets, reports: this room).

Which requests are recorded: every chat, completions, Responses and Messages request that passed
authentication, validation, the rate limit and the budget — once it is over, whatever its status:
finished, refused by the engine (400), cut by an engine fault (503), or abandoned by its client
(499). Counting tokens (``count_tokens``, ``/tokenize``) generates nothing and is not recorded.

The tokens recorded: the engine's usage when the answer finished, else the replica's own count of
what the engine generated (``engine/token_count.py``) — a request whose client left after N tokens
is recorded with N, stream or not.

A request failed over to a peer region is recorded once, by the region that served it (the peer,
with ``failover_origin`` naming this region); this region records it only when no peer did. A
stream a peer region continued after this region's engine failed (``router/resume.py``) is
recorded here, with what this region's engines did; the peer writes what its engine did in a row
that ``continues`` this one (``record_continuation``): tokens of the request, not a request.
"""

from pathlib import Path

from serve_app.auth.principal import Principal
from serve_app.config.model import REQUEST_TIMEOUT_S
from serve_app.telemetry.logs import module_logger
from serve_app.telemetry.timing import RequestRecord
from serve_app.usage.budgets import BudgetGuard, Reservation
from serve_app.usage.ledger import UsageLedger
from serve_app.usage.records import UsageRecord
from serve_app.usage.report import ReportQueue
from serve_app.usage.store import UsageStore
from serve_app.wire.messages import Generated

logger = module_logger(__name__)

# How far a sender's ``started_at_ms`` may stand from this region's clock: a stream lives at most
# the request timeout, and the regions' clocks and the resume's window add a few minutes. Beyond
# that the row is dated by this region's clock: a sender cannot date tokens into a closed month,
# or into a future day that every budget from now until then would count.
_SKEW_MS = 300_000
_OLDEST_MS = REQUEST_TIMEOUT_S * 1000 + _SKEW_MS


class Meter:
    def __init__(
        self, store: UsageStore, spool_dir: Path, *, region: str, writer_id: str, cache_ttl_s: float,
        flush_interval_s: float = 1.0,
    ):
        self.region = region
        self.ledger = UsageLedger(store, spool_dir, writer_id=writer_id, flush_interval_s=flush_interval_s)
        self.budgets = BudgetGuard(store, self.ledger, cache_ttl_s=cache_ttl_s)
        self.ledger.on_written = self.budgets.written  # a written batch counts in its running total
        self.store = store
        self.reports = ReportQueue()  # ``GET /v1/usage``, off the threads the ledger and budgets use

    def start(self) -> None:
        """Begin writing records in the background (call inside the router's event loop)."""
        self.ledger.start()

    async def aclose(self) -> None:
        """Stop taking usage reports, and write what is pending: to the database within the
        ledger's bound (``CLOSE_WRITE_S``), the rest to the spool."""
        self.reports.close()
        await self.ledger.aclose()

    async def reserve(self, caller: Principal, tokens: int) -> Reservation:
        """Hold ``tokens`` against the caller's token budget (its ``x-budget-*`` headers on the
        reservation), or 429 ``budget_exceeded``: spent, or too little left for this request."""
        return await self.budgets.reserve(caller.key_id, tokens)

    def record(self, record_id: str, caller: Principal, request: RequestRecord, generated: Generated | None,
               *, origin: str | None, stored_bytes: int = 0, resumes: int = 0,
               resume_prompt_tokens: int = 0, peer_part: bool = False) -> UsageRecord | None:
        """Queue the usage record of one admitted request that is over, and return it (None: not
        recorded here). ``origin``: the region that forwarded it here, if one did. ``peer_part``:
        a peer region continued the stream and records its part: ``generated`` is this region's."""
        if origin is not None and request.status == 503 and request.model_replica is None:
            return None  # forwarded here and not served either: the forwarding region records its 503
        try:
            record = usage_record(record_id, caller, request, generated, region=self.region, origin=origin,
                                  stored_bytes=stored_bytes, resumes=resumes,
                                  resume_prompt_tokens=resume_prompt_tokens, peer_part=peer_part)
            self.ledger.record(record)
        except Exception:  # metering must never fail the request it meters
            logger.exception("could not record usage of request %s", record_id)
            return None
        return record

    def record_continuation(self, continuation, caller: Principal, request: RequestRecord, generated: Generated,
                            *, origin: str | None, prompt_counted_there: bool, tail: int) -> UsageRecord | None:
        """Queue the row of a peer's stream this region continued (``resume.Continuation``): what
        its engine generated, whatever became of the stream (the sender cannot count it once it
        hung up); the customer's prompt too when no engine there counted it (its first died
        before its first output); its prefill (the prompt and the ``tail`` generated there) as
        resume prompt, engine work."""
        here_ms = request.start_ns // 1_000_000
        started_ms = continuation.started_at_ms  # the sender's: the request's day, as its record's
        if started_ms is None or not here_ms - _OLDEST_MS <= started_ms <= here_ms + _SKEW_MS:
            started_ms = here_ms
        ended_ms = max(started_ms, here_ms + round(request.server_ms or 0))  # the regions' clocks differ
        try:
            record = UsageRecord(
                id=continuation.record_id, key_id=caller.key_id, owner=caller.owner, region=self.region,
                model=request.model or "", route=request.route,
                # (``tail`` is empty then: no engine there generated before its first output.)
                prompt_tokens=0 if prompt_counted_there else max(0, generated.prompt_tokens - tail),
                completion_tokens=generated.completion_tokens,
                cached_tokens=0 if prompt_counted_there else generated.cached_tokens,
                status=request.status, finish_reason=request.finish_reasons[0] if request.finish_reasons else None,
                started_at_ms=started_ms, ended_at_ms=ended_ms,
                failover_origin=origin, resume_prompt_tokens=generated.prompt_tokens,
                continues=continuation.continues,
            )
            self.ledger.record(record)
        except Exception:  # metering must never fail the request it meters
            logger.exception("could not record the continuation of request %s", continuation.continues)
            return None
        return record


def usage_record(record_id: str, caller: Principal, request: RequestRecord, generated: Generated | None,
                 *, region: str, origin: str | None, stored_bytes: int = 0, resumes: int = 0,
                 resume_prompt_tokens: int = 0, peer_part: bool = False) -> UsageRecord:
    counted = generated or Generated()
    # The engine's usage when the answer finished; the replica's count when it did not, or when
    # the usage the client got counts a peer's part, which the peer records.
    finished = request.output_tokens is not None and not peer_part
    prompt = request.input_tokens if finished and request.input_tokens is not None else counted.prompt_tokens
    completion = request.output_tokens if finished else counted.completion_tokens
    started_ms = request.start_ns // 1_000_000
    return UsageRecord(
        id=record_id,
        key_id=caller.key_id,
        owner=caller.owner,
        region=region,
        model=request.model or "",
        route=request.route,
        prompt_tokens=int(prompt or 0),
        completion_tokens=int(completion or 0),
        cached_tokens=int(counted.cached_tokens or 0),
        status=request.status,
        finish_reason=request.finish_reasons[0] if request.finish_reasons else None,
        started_at_ms=started_ms,
        ended_at_ms=started_ms + round(request.server_ms or 0),
        failover_origin=origin,
        stored_bytes=stored_bytes,
        resumes=resumes,
        resume_prompt_tokens=resume_prompt_tokens,
        resumed_in=request.resumed_in,
    )
